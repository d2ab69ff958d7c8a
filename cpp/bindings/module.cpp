#include "bindings/common.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "fastload's native core: the I/O engine, the copier, digests";
  fastload::bindings::register_errors(m);
  fastload::bindings::register_io(m);
  fastload::bindings::register_hash(m);
  fastload::bindings::register_copy(m);
  fastload::bindings::register_index(m);
  fastload::bindings::register_extract(m);
  fastload::bindings::register_pack(m);
  fastload::bindings::register_collate(m);
  fastload::bindings::register_shm(m);
  fastload::bindings::register_order(m);
  fastload::bindings::register_objects(m);
}
