// StepScore: what the last pipeline stage scored in a step's microbatches —
// the one struct for it (model::GptStage::score(), StageModel::score(), the
// executor's step report).
#ifndef BATON_WORKER_MODEL_STEP_SCORE_H_
#define BATON_WORKER_MODEL_STEP_SCORE_H_

#include <cstdint>

namespace baton::model {

// What the last stage scored in the microbatches run forward since ZeroGrad().
struct StepScore {
  double loss_sum = 0.0;  // cross-entropy summed over scored tokens
  int64_t tokens = 0;     // scored tokens (targets other than -1)
  int64_t correct = 0;    // scored tokens whose first (lowest-index) maximum logit is the target
};

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_STEP_SCORE_H_
