// The options every detector is created with. Each detector declares its own
// options struct in its header (router_detector.h, ...) next to the code
// that reads it, and finds it here by type: the registry, the worker pool
// and foreshockctl backtest pass one DetectorOptions through without knowing
// any detector's fields. A detector whose options were never set gets its
// struct's defaults.
#pragma once

#include <any>
#include <map>
#include <typeindex>

namespace foreshock::detectors {

class DetectorOptions {
 public:
  // The options of type O: the ones set, else O's defaults.
  template <typename O>
  const O& Get() const {
    static const O kDefaults{};
    const auto it = options_.find(std::type_index(typeid(O)));
    return it == options_.end() ? kDefaults : *std::any_cast<O>(&it->second);
  }
  // The options of type O to change (O's defaults until then).
  template <typename O>
  O& Mutable() {
    std::any& slot = options_[std::type_index(typeid(O))];
    if (!slot.has_value()) slot = O{};
    return *std::any_cast<O>(&slot);
  }
  // Sets O's options: DetectorOptions().With(QKDetectorOptions{...}).
  template <typename O>
  DetectorOptions& With(O options) {
    Mutable<O>() = std::move(options);
    return *this;
  }

 private:
  std::map<std::type_index, std::any> options_;  // by value: a copy is independent
};

}  // namespace foreshock::detectors
