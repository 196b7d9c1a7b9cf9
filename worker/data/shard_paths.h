// ExpandTokenShards: the shard files `data.tokens_file` names, in the order
// they are read, all confined to the worker's --data_dir.
//
// `spec` (relative to data_dir, or absolute inside it) is one of
//   - a glob (it holds '*', '?' or '['): every match, sorted bytewise;
//   - a directory: its entries named *.bin (for megatron *.idx), not hidden
//     ones, sorted bytewise, not recursive;
//   - a file (for megatron a prefix: PREFIX.idx and PREFIX.bin; a spec
//     ending in .idx or .bin is taken as its prefix).
// For megatron each result is a prefix (a glob's or directory's X.idx and
// X.bin give one prefix X); otherwise each result is a file.
//
// Every file is checked to resolve (symlinks followed) to a regular file
// under data_dir; at most kMaxTokenShards results (each shard is one mapping,
// and the kernel's vm.max_map_count is 65,530 by default). Errors name
// `field`: FAILED_PRECONDITION when data_dir is empty, NOT_FOUND for a glob
// that matches nothing, an empty directory or a missing file,
// PERMISSION_DENIED for a file outside data_dir, INVALID_ARGUMENT for a
// match that is not a regular file or too many shards.
#ifndef BATON_WORKER_DATA_SHARD_PATHS_H_
#define BATON_WORKER_DATA_SHARD_PATHS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/token_shards.h"

namespace baton::data {

inline constexpr int kMaxTokenShards = 16384;

absl::StatusOr<std::vector<std::string>> ExpandTokenShards(const std::string& data_dir, const std::string& spec,
                                                           TokenFormat format, const std::string& field);

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_SHARD_PATHS_H_
