// foreshockctl's commands that read recordings (foreshockd --record_dir):
// replay them into a daemon, or backtest an alert configuration on them
// offline (docs/foreshockctl.md).
#pragma once

#include "ctl/cli.h"
#include "ctl/connection.h"

namespace foreshock::ctl {

int RunReplay(const Args& args, const Globals& g);
int RunBacktestCommand(const Args& args, const Globals& g);

}  // namespace foreshock::ctl
