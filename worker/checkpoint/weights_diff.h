// Moved to common/weights_diff.h (batonctl and tests need it without the
// worker's internals); this header keeps old includes working.
#ifndef BATON_WORKER_CHECKPOINT_WEIGHTS_DIFF_H_
#define BATON_WORKER_CHECKPOINT_WEIGHTS_DIFF_H_

#include "common/weights_diff.h"

#endif  // BATON_WORKER_CHECKPOINT_WEIGHTS_DIFF_H_
