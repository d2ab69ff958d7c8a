// The one permutation (common/permutation.hpp) at the boundary, as a numpy array.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings/common.hpp"
#include "common/permutation.hpp"

namespace fastload::bindings {

void register_order(py::module_& m) {
  m.def(
      "permutation",
      [](int64_t n, const std::vector<uint64_t>& words) {
        if (n < 0) throw py::value_error("n must be non-negative, not " + std::to_string(n));
        py::array_t<int64_t> out(n);
        int64_t* p = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          permutation(words, std::span<int64_t>(p, size_t(n)));
        }
        return out;
      },
      py::arg("n"), py::arg("words"),
      "The permutation of range(n) (int64) determined by words (integers in [0, 2**64)), "
      "defined bit for bit in cpp/common/permutation.hpp.");
}

}  // namespace fastload::bindings
