// data.token_format (proto/baton/v1/job.proto): how a job's token files are
// stored. One list of names for the coordinator's job check and the worker's
// reader (worker/data/token_shards.h).
#ifndef BATON_COMMON_TOKEN_FORMAT_H_
#define BATON_COMMON_TOKEN_FORMAT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace baton {

enum class TokenFormat { kRawUint16, kRawUint32, kLlmc, kMegatron };

// "" and "raw_uint16" are kRawUint16; an unknown name is INVALID_ARGUMENT
// listing the known ones.
absl::StatusOr<TokenFormat> ParseTokenFormat(absl::string_view name);
const char* TokenFormatName(TokenFormat format);

}  // namespace baton

#endif  // BATON_COMMON_TOKEN_FORMAT_H_
