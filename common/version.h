// The baton version, reported in Register, baton_build_info and --version.
#ifndef BATON_COMMON_VERSION_H_
#define BATON_COMMON_VERSION_H_

namespace baton {

inline constexpr char kVersion[] = "0.1.0";

}  // namespace baton

#endif  // BATON_COMMON_VERSION_H_
