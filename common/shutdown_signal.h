// ShutdownSignal: SIGTERM/SIGINT as an event a daemon's main thread waits for.
//
// A handler (installed for the whole process) writes the signal number to a
// pipe; WaitForShutdownSignal() reads it. This works whichever thread the
// kernel picks to deliver the signal to, including threads that libraries
// start before main() (OpenBLAS's pool), which a sigmask set in main() would
// not cover.
#ifndef BATON_COMMON_SHUTDOWN_SIGNAL_H_
#define BATON_COMMON_SHUTDOWN_SIGNAL_H_

namespace baton {

// Installs the handlers; call once, early in main().
void InstallShutdownSignalHandlers();

// Blocks until SIGTERM or SIGINT arrives; returns the signal number.
int WaitForShutdownSignal();

// Like WaitForShutdownSignal(), but returns 0 when no signal came within
// `timeout_ms` (a daemon's main loop does periodic work between waits).
int WaitForShutdownSignalFor(int timeout_ms);

}  // namespace baton

#endif  // BATON_COMMON_SHUTDOWN_SIGNAL_H_
