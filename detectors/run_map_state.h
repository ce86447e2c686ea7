// Saving and restoring a detector's per-run map (run name -> state), the
// skeleton the run-level detectors share: a version, the run count, then per
// run its name and the fields the detector writes. Restoring is all or
// nothing: a failed read leaves the map empty; runs that `keep` rejects are
// skipped; a run saved twice is refused.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "detectors/detector.h"
#include "codec/state_codec.h"

namespace foreshock::detectors {

// Writes `runs`: U32 version, U64 count, then per run String name and what
// put(writer, state) writes.
template <typename Map, typename Put>
void SaveRunMap(codec::StateWriter& writer, uint32_t version, const Map& runs, Put put) {
  writer.PutU32(version);
  writer.PutU64(runs.size());
  for (const auto& [name, state] : runs) {
    writer.PutString(name);
    put(writer, state);
  }
}

// Reads what SaveRunMap wrote (version `version` of `what`) into `runs`: each
// state is made by make() and filled by get(reader, state), which returns
// false on a short or invalid read. Restored runs replace those of the same
// name; on failure `runs` is cleared and false returned.
template <typename Map, typename Make, typename Get>
bool RestoreRunMap(codec::StateReader& reader, std::string_view what, uint32_t version,
                   const SeriesFilter& keep, Map& runs, Make make, Get get) {
  Map restored;
  auto read = [&]() -> bool {
    uint32_t saved_version = 0;
    uint64_t count = 0;
    if (!reader.GetVersion(what, version, version, saved_version) || !reader.GetCount(count)) {
      return false;
    }
    for (uint64_t i = 0; i < count; ++i) {
      std::string name;
      auto state = make();
      if (!reader.GetString(name) || !get(reader, state)) return false;
      if (keep && !keep(name, kNoLayer)) continue;
      if (!restored.emplace(std::move(name), std::move(state)).second) {
        return reader.Fail("run saved twice");
      }
    }
    return true;
  };
  if (!read()) {
    runs.clear();
    return false;
  }
  for (auto& [name, state] : restored) runs.insert_or_assign(name, std::move(state));
  return true;
}

}  // namespace foreshock::detectors
