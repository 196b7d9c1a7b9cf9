#include "common/token_format.h"

#include "absl/strings/str_cat.h"

namespace baton {

absl::StatusOr<TokenFormat> ParseTokenFormat(absl::string_view name) {
  if (name.empty() || name == "raw_uint16") return TokenFormat::kRawUint16;
  if (name == "raw_uint32") return TokenFormat::kRawUint32;
  if (name == "llmc") return TokenFormat::kLlmc;
  if (name == "megatron") return TokenFormat::kMegatron;
  return absl::InvalidArgumentError(
      absl::StrCat("data.token_format = \"", name, "\": unknown; use \"raw_uint16\" (the default), \"raw_uint32\", "
                   "\"llmc\" or \"megatron\""));
}

const char* TokenFormatName(TokenFormat format) {
  switch (format) {
    case TokenFormat::kRawUint16: return "raw_uint16";
    case TokenFormat::kRawUint32: return "raw_uint32";
    case TokenFormat::kLlmc: return "llmc";
    case TokenFormat::kMegatron: return "megatron";
  }
  return "unknown";
}

}  // namespace baton
