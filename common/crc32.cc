#include "common/crc32.h"

#include <zlib.h>

#include <algorithm>

namespace baton {

uint32_t Crc32(absl::string_view bytes, uint32_t crc) {
  uLong c = crc;
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  // zlib takes uInt lengths; feed large buffers in pieces.
  while (left > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(left, size_t{1} << 30));
    c = crc32(c, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(c);
}

}  // namespace baton
