// FormatBytes: a byte count for people, in binary units ("512 B", "1.5 GiB"),
// for error messages that say how much memory was needed or held.
#ifndef BATON_COMMON_FORMAT_BYTES_H_
#define BATON_COMMON_FORMAT_BYTES_H_

#include <string>

namespace baton {

// "0 B", "960 B", "1.0 KiB", "3.1 GiB": one decimal from KiB up (doubles,
// since estimates of absurd specs exceed int64).
std::string FormatBytes(double bytes);

}  // namespace baton

#endif  // BATON_COMMON_FORMAT_BYTES_H_
