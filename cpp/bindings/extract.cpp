#include <pybind11/stl.h>

#include <exception>
#include <functional>

#include "bindings/common.hpp"
#include "common/error.hpp"
#include "copy/decompress.hpp"
#include "copy/extract.hpp"
#include "io/engine.hpp"

namespace fastload::bindings {

namespace {

// A read block lent by an ExtractJob, as a writable buffer; it keeps the blocks' memory
// alive, so a view outliving the job reads freed memory never.
struct ReadBlock {
  std::shared_ptr<char[]> memory;
  char* data;
  size_t size;
};

copy::Compression parse_compression(const std::string& name) {
  if (name == "gzip") return copy::Compression::kGzip;
  if (name == "zstd") return copy::Compression::kZstd;
  if (name == "none") return copy::Compression::kNone;
  throw py::value_error("unknown compression '" + name + "'");
}

const char* compression_name(copy::Compression c) {
  switch (c) {
    case copy::Compression::kGzip: return "gzip";
    case copy::Compression::kZstd: return "zstd";
    default: return "none";
  }
}

}  // namespace

void register_extract(py::module_& m) {
  m.def("zstd_available", &copy::zstd_available, "True when libzstd.so.1 can be loaded.");
  m.def(
      "zstd_compress",
      [](const py::buffer& data, int level, const std::string& name) {
        py::buffer_info info = data.request();
        std::span<const char> b = contiguous_bytes(info, "zstd_compress");
        std::string out;
        {
          py::gil_scoped_release nogil;
          out = copy::zstd_compress(b.data(), b.size(), level, name);
        }
        return py::bytes(out);
      },
      py::arg("data"), py::arg("level"), py::arg("name"),
      "data as one zstd frame (libzstd.so.1 loaded at run time).");
  m.def(
      "decompress_to",
      [](const py::buffer& data, const std::string& compression, int fd, uint64_t limit,
         const std::string& name) {
        copy::Compression c = parse_compression(compression);
        py::buffer_info info = data.request();
        std::span<const char> b = contiguous_bytes(info, "decompress_to");
        py::gil_scoped_release nogil;
        return copy::decompress_to_fd(c, b.data(), b.size(), fd, limit, name);
      },
      py::arg("data"), py::arg("compression"), py::arg("fd"), py::arg("limit"), py::arg("name"),
      "Decodes data (a whole gzip or zstd stream) into fd from offset 0, at most limit "
      "bytes; returns the bytes written.");

  py::class_<ReadBlock>(m, "ReadBlock", py::buffer_protocol(),
                        "A buffer an ExtractJob lends for reading the archive into.")
      .def_buffer([](ReadBlock& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(b.size)}, {py::ssize_t(1)}, false);
      });

  const copy::ExtractOptions defaults;
  py::class_<copy::ExtractOptions>(m, "ExtractOptions", "How an ExtractJob runs.")
      .def(py::init([](const std::string& compression, bool nested,
                       const std::vector<std::string>& include,
                       const std::vector<std::string>& exclude, const py::dict& complete,
                       const std::string& engine, const py::object& engine_path,
                       unsigned threads, unsigned files_in_flight, uint64_t chunk_size,
                       bool adopt_existing, size_t read_block_size, unsigned read_blocks,
                       uint64_t direct_write_min) {
             copy::ExtractOptions opt;
             opt.compression = parse_compression(compression);
             opt.engine.kind = engine_kind(engine);
             if (!engine_path.is_none()) opt.engine.where = fs_bytes(engine_path);
             opt.engine.threads = threads;
             opt.nested = nested;
             opt.include = include;
             opt.exclude = exclude;
             for (auto item : complete) {
               auto rec = item.second.cast<py::tuple>();
               opt.complete.emplace(fs_bytes(item.first),
                                    std::make_pair(rec[0].cast<uint64_t>(), rec[1].cast<int64_t>()));
             }
             opt.files_in_flight = files_in_flight;
             opt.chunk_size = chunk_size;
             opt.adopt_existing = adopt_existing;
             if (read_block_size) opt.read_block_size = read_block_size;
             if (read_blocks) opt.read_blocks = read_blocks;
             opt.direct_write_min = direct_write_min;
             return opt;
           }),
           py::kw_only(), py::arg("compression") = "none", py::arg("nested") = false,
           py::arg("include") = std::vector<std::string>{},
           py::arg("exclude") = std::vector<std::string>{}, py::arg("complete") = py::dict(),
           py::arg("engine") = "auto", py::arg("engine_path") = py::none(),
           py::arg("threads") = defaults.engine.threads,
           py::arg("files_in_flight") = defaults.files_in_flight,
           py::arg("chunk_size") = defaults.chunk_size, py::arg("adopt_existing") = false,
           py::arg("read_block_size") = 0, py::arg("read_blocks") = 0,
           py::arg("direct_write_min") = defaults.direct_write_min)
      .def_property_readonly("compression",
                             [](const copy::ExtractOptions& o) { return compression_name(o.compression); })
      .def_property(
          "engine", [](const copy::ExtractOptions& o) { return io::kind_name(o.engine.kind); },
          [](copy::ExtractOptions& o, const std::string& e) { o.engine.kind = engine_kind(e); })
      .def_property(
          "threads", [](const copy::ExtractOptions& o) { return o.engine.threads; },
          [](copy::ExtractOptions& o, unsigned v) { o.engine.threads = v; })
      .def_readwrite("nested", &copy::ExtractOptions::nested)
      .def_readwrite("files_in_flight", &copy::ExtractOptions::files_in_flight)
      .def_readwrite("chunk_size", &copy::ExtractOptions::chunk_size)
      .def_readwrite("adopt_existing", &copy::ExtractOptions::adopt_existing)
      .def_readwrite("read_block_size", &copy::ExtractOptions::read_block_size)
      .def_readwrite("read_blocks", &copy::ExtractOptions::read_blocks)
      .def_readwrite("direct_write_min", &copy::ExtractOptions::direct_write_min);

  py::class_<copy::ExtractJob>(m, "ExtractJob", "Streaming extraction of a tar archive.")
      .def(py::init([](const py::object& dst, const py::object& name,
                       const copy::ExtractOptions& options) {
             std::string d = fs_bytes(dst), n = fs_bytes(name);
             copy::ExtractOptions opt = options;
             py::gil_scoped_release nogil;
             return new copy::ExtractJob(d, n, std::move(opt));
           }),
           py::arg("dst"), py::arg("name"), py::arg("options"))
      .def(
          "feed",
          [](copy::ExtractJob& j, const py::buffer& data) {
            py::buffer_info info = data.request();
            const char* p = static_cast<const char*>(info.ptr);
            size_t n = size_t(info.size * info.itemsize);
            py::gil_scoped_release nogil;
            j.feed(p, n);
          },
          py::arg("data"))
      .def(
          "lend",
          [](copy::ExtractJob& j, bool wait) -> py::object {
            int b;
            {
              py::gil_scoped_release nogil;
              b = j.lend(wait);
            }
            if (b < 0) return py::none();
            return py::make_tuple(b, ReadBlock{j.block_storage(), j.block(b), j.block_size()});
          },
          py::arg("wait"),
          "(index, buffer) of a free read block, or None when none is free and not wait.")
      .def("feed_block", &copy::ExtractJob::feed_block, py::arg("block"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      .def("release", &copy::ExtractJob::release, py::arg("block"))
      .def("map_source", &copy::ExtractJob::map_source, py::arg("fd"), py::arg("size"))
      .def("populate", &copy::ExtractJob::populate, py::arg("offset"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      .def("feed_mapped", &copy::ExtractJob::feed_mapped, py::arg("offset"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "read_source",
          [](copy::ExtractJob& j, int fd, int direct_fd, uint64_t size, unsigned depth,
             const py::object& tick, const py::object& where, const py::object& hash,
             size_t stripe) {
            copy::SourceFile src;
            src.fd = fd;
            src.direct_fd = direct_fd;
            src.size = size;
            src.depth = depth;
            src.stripe = stripe;
            if (!where.is_none()) src.where = fs_bytes(where);
            // tick runs on this thread with the GIL taken back; Ctrl-C (a pending
            // signal) or its exception stops the reading: kept here, the core sees a
            // cancel, and it is raised once the core has unwound.
            std::exception_ptr raised, hash_raised;
            std::function<void(uint64_t)> cb = [&](uint64_t offset) {
              py::gil_scoped_acquire gil;
              try {
                if (PyErr_CheckSignals() != 0) throw py::error_already_set();
                if (!tick.is_none()) tick(offset);
              } catch (...) {
                raised = std::current_exception();
                throw Error(ErrorKind::kCancelled, 0, "extraction interrupted", "");
              }
            };
            // hash(block) on the core's hasher thread, the GIL taken for the call only
            // (hashlib releases it while hashing a buffer). The buffer keeps the blocks'
            // memory alive; the core keeps the block from reuse until the call returns.
            // Captured by reference: nothing Python is copied without the GIL.
            std::shared_ptr<char[]> storage = j.block_storage();
            if (!hash.is_none())
              src.hash = [&hash, &hash_raised, storage](const char* p, size_t n) {
                py::gil_scoped_acquire gil;
                try {
                  hash(ReadBlock{storage, const_cast<char*>(p), n});
                } catch (...) {
                  hash_raised = std::current_exception();
                  throw Error(ErrorKind::kCancelled, 0, "hashing the archive failed", "");
                }
              };
            copy::SourceReads r;
            try {
              py::gil_scoped_release nogil;
              r = j.read_source(src, cb);
            } catch (const Error&) {
              if (raised) std::rethrow_exception(raised);
              if (hash_raised) std::rethrow_exception(hash_raised);
              throw;
            }
            return py::make_tuple(r.bytes, r.blocks, r.direct_blocks, r.wait_ns * 1e-9,
                                  r.feed_ns * 1e-9, r.hash_wait_ns * 1e-9, r.engine);
          },
          py::arg("fd"), py::arg("direct_fd"), py::arg("size"), py::arg("depth"),
          py::arg("tick") = py::none(), py::kw_only(), py::arg("where") = py::none(),
          py::arg("hash") = py::none(), py::arg("stripe") = 0,
          "Reads the archive from fd (direct_fd: the same file opened O_DIRECT, or -1) "
          "and feeds it, the GIL released; tick(offset) between blocks; where: the "
          "archive's path, whose file system the engine rule picks the reads' backend "
          "for (None: the job's); hash(buffer): each block in order, on a thread of the "
          "job's (nothing is seeked over); stripe: buffered blocks read in stripes of this "
          "size, each a read in flight (0: whole). Returns (bytes read, blocks, blocks read "
          "O_DIRECT, seconds waiting for reads, seconds feeding the blocks to the "
          "extractor, seconds waiting for the hasher, the reads' backend).")
      .def_property_readonly("block_size", &copy::ExtractJob::block_size)
      .def("finish", &copy::ExtractJob::finish, py::call_guard<py::gil_scoped_release>())
      .def("skippable", &copy::ExtractJob::skippable)
      .def("skipped", &copy::ExtractJob::skipped, py::arg("n"))
      .def("cancel", &copy::ExtractJob::cancel)
      .def("abort", &copy::ExtractJob::abort, py::call_guard<py::gil_scoped_release>())
      .def("take_done",
           [](copy::ExtractJob& j) {
             auto done = j.take_done();
             py::list out(done.size());
             for (size_t i = 0; i < done.size(); ++i) {
               const auto& f = done[i];
               out[i] = py::make_tuple(
                   fs_str(f.path), f.size, f.mode, f.mtime_ns,
                   py::bytes(reinterpret_cast<const char*>(f.digests.data()),
                             f.digests.size() * sizeof(uint64_t)),
                   f.adopted);
             }
             return out;
           })
      .def("take_reused",
           [](copy::ExtractJob& j) {
             py::list out;
             for (const auto& p : j.take_reused()) out.append(fs_str(p));
             return out;
           })
      .def("take_warnings",
           [](copy::ExtractJob& j) {
             py::list out;
             for (const auto& w : j.take_warnings()) out.append(fs_str(w));
             return out;
           })
      .def("links",
           [](const copy::ExtractJob& j) {
             py::list out;
             for (const auto& l : j.links())
               out.append(py::make_tuple(fs_str(l.path), fs_str(l.target), l.hard));
             return out;
           })
      .def("dirs",
           [](const copy::ExtractJob& j) {
             py::list out;
             for (const auto& d : j.dirs()) out.append(fs_str(d));
             return out;
           })
      .def_property_readonly("bytes_in", &copy::ExtractJob::bytes_in)
      .def_property_readonly("bytes_out", &copy::ExtractJob::bytes_out)
      .def_property_readonly("bytes_direct", &copy::ExtractJob::bytes_direct)
      .def_property_readonly("files_done", &copy::ExtractJob::files_done)
      .def_property_readonly("files_skipped", &copy::ExtractJob::files_skipped)
      .def_property_readonly("engine", &copy::ExtractJob::engine_name)
      .def_property_readonly("compression",
                             [](const copy::ExtractJob& j) { return compression_name(j.compression()); });
}

}  // namespace fastload::bindings
