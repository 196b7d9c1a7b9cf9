// CRC-32 (zlib's polynomial, as in gzip and PNG) over any number of bytes.
#ifndef BATON_COMMON_CRC32_H_
#define BATON_COMMON_CRC32_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace baton {

// CRC-32 of `bytes`, continuing from `crc` (0 to start).
uint32_t Crc32(absl::string_view bytes, uint32_t crc = 0);

}  // namespace baton

#endif  // BATON_COMMON_CRC32_H_
