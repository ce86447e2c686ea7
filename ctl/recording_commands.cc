// foreshockctl replay and backtest (recording_commands.h).
#include "ctl/recording_commands.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "alerts/config.h"
#include "ctl/backtest.h"
#include "ctl/replay.h"

namespace foreshock::ctl {

int RunReplay(const Args& args, const Globals& g) {
  if (!args.Has("to") || args.Get("to").empty()) {
    std::fprintf(stderr, "foreshockctl replay: --to HOST:PORT is required (the daemon to replay into)\n");
    return kExitUsage;
  }
  const std::string speed_name = args.Get("speed", "max");
  ReplaySpeed speed;
  if (speed_name == "max") {
    speed = ReplaySpeed::kMax;
  } else if (speed_name == "realtime") {
    speed = ReplaySpeed::kRealtime;
  } else {
    std::fprintf(stderr, "foreshockctl replay: --speed is max or realtime, not '%s'\n",
                 speed_name.c_str());
    return kExitUsage;
  }
  // Every file must be a recording before anything is sent.
  int64_t origin = INT64_MAX;
  for (const std::string& path : args.positional) {
    record::RecordingReader reader;
    if (!reader.Open(path)) {
      std::fprintf(stderr, "foreshockctl replay: %s\n", reader.error().c_str());
      return kExitUsage;
    }
    if (auto first = FirstFrameTime(path)) origin = std::min(origin, *first);
  }
  Globals target = g;
  target.endpoint = args.Get("to");
  target.endpoint_flag = "--to";
  auto channel = Connect(target);
  if (!channel) return kExitUsage;

  // One stream per file, all at once: several ranks' recordings interleave as
  // they did live (exactly so with --speed realtime).
  std::vector<ReplayResult> results(args.positional.size());
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < args.positional.size(); ++i) {
    threads.emplace_back([&, i] {
      results[i] = ReplayFile(channel, args.positional[i], speed, origin, start);
    });
  }
  for (std::thread& t : threads) t.join();

  bool all_ok = true;
  if (g.json) std::cout << "[";
  for (size_t i = 0; i < results.size(); ++i) {
    all_ok = all_ok && results[i].ok();
    if (g.json) {
      std::cout << (i ? ",\n " : "") << results[i].Json();
    } else {
      std::cout << results[i].Summary() << '\n';
    }
  }
  if (g.json) std::cout << "]\n";
  std::cout << std::flush;
  return all_ok ? kExitOk : kExitFailed;
}

int RunBacktestCommand(const Args& args, const Globals& g) {
  BacktestOptions options;
  if (args.Has("config")) {
    auto config = alerts::LoadAlertConfigFile(args.Get("config"));
    if (!config.ok()) {
      std::fprintf(stderr, "foreshockctl backtest: %s\n", std::string(config.status().message()).c_str());
      return kExitUsage;
    }
    options.config = *std::move(config);
  }
  if (args.Has("divergence_warmup")) {
    auto v = ParseInt(args.Get("divergence_warmup"));
    if (!v || *v < 0) {
      std::fprintf(stderr, "foreshockctl backtest: --divergence_warmup is a step count >= 0\n");
      return kExitUsage;
    }
    options.divergence_warmup = *v;
  }
  if (args.Has("gradnorm_z")) {
    char* end = nullptr;
    const std::string text = args.Get("gradnorm_z");
    const double z = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(z > 0)) {
      std::fprintf(stderr, "foreshockctl backtest: --gradnorm_z is a number > 0\n");
      return kExitUsage;
    }
    options.gradnorm_z = z;
  }
  if (args.Has("signals")) {
    const auto mode = ParseBacktestSignals(args.Get("signals"));
    if (!mode) {
      std::fprintf(stderr, "foreshockctl backtest: --signals is all, mechanism, direct or no_lr\n");
      return kExitUsage;
    }
    options.signals = *mode;
  }
  if (args.Has("dump_series")) {
    std::stringstream names(args.Get("dump_series"));
    for (std::string name; std::getline(names, name, ',');) {
      if (!name.empty()) options.dump_signals.insert(name);
    }
  }
  // Files, or directories of recordings (foreshockd --record_dir).
  std::vector<std::string> files;
  for (const std::string& path : args.positional) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::recursive_directory_iterator(path, ec)) {
        if (entry.is_regular_file() && entry.path().extension() == record::kRecordingExtension) {
          found.push_back(entry.path().string());
        }
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(path);
    }
  }
  const BacktestResult result = RunBacktest(files, options);
  if (g.json) {
    std::cout << BacktestJson(result);
  } else {
    std::cout << BacktestTable(result) << '\n' << BacktestSummary(result);
  }
  std::cout << std::flush;
  bool ok = result.errors.empty();
  for (const BacktestRun& run : result.runs) ok = ok && run.error.empty();
  return ok ? kExitOk : kExitFailed;
}

}  // namespace foreshock::ctl
