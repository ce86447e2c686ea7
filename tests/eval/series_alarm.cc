// Scores series given on stdin with the daemon's own change detector
// (alerts/change_detector.h), for evaluating a candidate signal offline
// (tests/eval/weight_qk.py) by the same rule as the shipped ones.
//
//   foreshock_series_alarm [--direction rise|drop] [--min_relative_change R]
//                          [--min_absolute_change A] [--trend 0|1] < series.txt
//
// Input: one sample per line, "SERIES STEP VALUE" (SERIES a name without
// spaces; each series' steps ascending; non-finite values skipped, as the
// daemon does). Output: one line per series that became anomalous,
// "SERIES ALARM_STEP ONSET_STEP" (the step at which persistence was reached,
// and the episode's earliest anomalous step), in the order first seen. Every
// other option is ChangeDetectorOptions' default, which is deploy/foreshock.yaml's.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "alerts/change_detector.h"

namespace {

int Usage() {
  std::fprintf(stderr,
               "usage: foreshock_series_alarm [--direction rise|drop] [--min_relative_change R] "
               "[--min_absolute_change A] [--trend 0|1] < 'SERIES STEP VALUE' lines\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using foreshock::alerts::ChangeDetector;
  using foreshock::alerts::ChangeDetectorOptions;
  using foreshock::alerts::Direction;
  using foreshock::alerts::SeriesState;
  ChangeDetectorOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return Usage();
    const char* value = argv[++i];
    char* end = nullptr;
    if (arg == "--direction") {
      if (std::strcmp(value, "rise") == 0) {
        options.direction = Direction::kRise;
      } else if (std::strcmp(value, "drop") == 0) {
        options.direction = Direction::kDrop;
      } else {
        return Usage();
      }
      continue;
    }
    const double number = std::strtod(value, &end);
    if (end == value || *end != '\0' || !std::isfinite(number)) return Usage();
    if (arg == "--min_relative_change") {
      options.min_relative_change = number;
    } else if (arg == "--min_absolute_change") {
      options.min_absolute_change = number;
    } else if (arg == "--trend") {
      options.trend = number != 0;
    } else {
      return Usage();
    }
  }

  std::map<std::string, std::unique_ptr<ChangeDetector>> detectors;
  std::map<std::string, bool> alarmed;
  std::vector<std::string> order;
  std::string name;
  long long step = 0;
  double value = 0;
  while (std::cin >> name >> step >> value) {
    if (!std::isfinite(value)) continue;
    auto& detector = detectors[name];
    if (!detector) {
      detector = std::make_unique<ChangeDetector>(options);
      order.push_back(name);
    }
    const auto assessment = detector->Update(step, value);
    if (assessment.state == SeriesState::kAnomalous && !alarmed[name]) {
      alarmed[name] = true;
      std::printf("%s %lld %lld\n", name.c_str(), step,
                  static_cast<long long>(assessment.onset_step));
    }
  }
  if (!std::cin.eof()) {
    std::fprintf(stderr, "foreshock_series_alarm: malformed input line\n");
    return 1;
  }
  return 0;
}
