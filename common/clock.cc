#include "common/clock.h"

namespace baton {

RealClock* RealClock::Get() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace baton
