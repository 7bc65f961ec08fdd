// spectral_cond._core: the tool's verify sweep for Python (docs/python.md): every statement of
// MATH.md §4–7 checked on seeded random instances, would-be violations re-checked in extended
// precision (spectral_cond/testing/extended.hpp, through the tool's extended_rechecks), the
// report as the tool's JSON (the engine's report_json.hpp, keys in docs/cli.md), which
// spectral_cond.verify wraps in a VerifyReport.
#include "binding.hpp"

#include <spectral_cond/engine/extended_rechecks.hpp>
#include <spectral_cond/engine/report_json.hpp>
#include <spectral_cond/engine/verify_sweep.hpp>

#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

namespace spectral_cond::python {
namespace {

std::string verify_py(std::uint64_t seed, std::int64_t instances_per_regime, bool extended,
                      const nb::object& progress) {
  if (instances_per_regime < 1)
    value_error("verify", "instances_per_regime must be >= 1 (got " +
                              std::to_string(instances_per_regime) + ")");
  VerifyOptions o;
  o.seed = seed;
  o.instances_per_regime = instances_per_regime;
  if (extended) o.rechecks = engine::extended_rechecks();
  Progress bridge(progress);
  o.progress = bridge.function();
  const VerifyReport rep = bridge.run([&] { return verify_sweep(o); });
  return engine::verify_json(rep).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

void bind_verify(nb::module_& m) {
  m.def("verify", &verify_py, nb::arg("seed"), nb::arg("instances_per_regime") = 16,
        nb::arg("extended") = true, nb::arg("progress") = nb::none(),
        "The verify sweep (MATH.md §4-7), as the tool's JSON text");
}

}  // namespace spectral_cond::python
