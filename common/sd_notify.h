// systemd service notification (sd_notify(3)) without libsystemd: one
// datagram to the unix socket named by $NOTIFY_SOCKET. Everything is a no-op
// when the daemon is not started by systemd with Type=notify.
//
//   SdNotify("READY=1")        start-up finished (serving, registered)
//   SdNotify("WATCHDOG=1")     alive; send at least every WatchdogPeriod()
//   SdNotify("STATUS=...")     one line shown by `systemctl status`
//   SdNotify("STOPPING=1")     shutting down
#ifndef BATON_COMMON_SD_NOTIFY_H_
#define BATON_COMMON_SD_NOTIFY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace baton {

// Sends `state` (newline-separated VAR=VALUE assignments) to $NOTIFY_SOCKET.
// OK when sent or when $NOTIFY_SOCKET is unset; an error saying why otherwise.
absl::Status SdNotify(const std::string& state);

// How often to send WATCHDOG=1: half of $WATCHDOG_USEC when systemd enabled the
// watchdog for this process ($WATCHDOG_PID unset or ours), else zero.
absl::Duration WatchdogPeriod();

}  // namespace baton

#endif  // BATON_COMMON_SD_NOTIFY_H_
