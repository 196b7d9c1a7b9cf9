#include "common/shutdown_signal.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace baton {
namespace {

int pipe_fds[2] = {-1, -1};

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // Async-signal-safe; a full pipe means a signal is already pending.
  [[maybe_unused]] ssize_t n = write(pipe_fds[1], &byte, 1);
  errno = saved;
}

}  // namespace

void InstallShutdownSignalHandlers() {
  if (pipe_fds[0] >= 0) return;
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return;
  fcntl(pipe_fds[1], F_SETFL, O_NONBLOCK);
  struct sigaction action = {};
  action.sa_handler = &OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

int WaitForShutdownSignal() {
  unsigned char byte = 0;
  for (;;) {
    // Wait in poll(), not in read(): ThreadSanitizer runs a handler only
    // when the thread it interrupted is in a call it knows blocks (poll is
    // one, read is not), else it defers it until that call returns -- a
    // read() of this pipe never would (the coordinator ignored SIGTERM
    // under scripts/tsan.sh).
    struct pollfd p = {pipe_fds[0], POLLIN, 0};
    if (poll(&p, 1, -1) < 0 && errno == EINTR) continue;
    ssize_t n = read(pipe_fds[0], &byte, 1);
    if (n == 1) return byte;
    if (n < 0 && errno == EINTR) continue;
    return SIGTERM;  // the pipe broke: treat as a request to stop
  }
}

int WaitForShutdownSignalFor(int timeout_ms) {
  struct pollfd p = {pipe_fds[0], POLLIN, 0};
  const int n = poll(&p, 1, timeout_ms);
  if (n == 0 || (n < 0 && errno == EINTR)) return 0;
  return WaitForShutdownSignal();  // readable (or broken): returns at once
}

}  // namespace baton
