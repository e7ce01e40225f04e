/* Force-included into the mlx-c unity build (never into bindgen). */
#pragma once
#include <version>
#include <string>
#include <sstream>

/* mlx-c declares its float16/bfloat16 accessors only on aarch64 (half.h), but mlx-rs calls them
 * on every target. Off aarch64 build.rs defines HAS_FLOAT16/HAS_BFLOAT16 and we name MLX's own
 * 16-bit types here; only pointers to them cross the C ABI. */
#if !defined(__aarch64__)
#include "mlx/types/half_types.h"
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#endif

/* Debian 12's libstdc++ (g++ 12) has no std::format; mlx-c uses it only to build error
 * messages with `{}` placeholders. A minimal stand-in, active only where <format> is missing. */
#ifndef __cpp_lib_format
namespace std {
namespace strata_compat {
inline void format_into(std::ostringstream& out, const char* fmt) { out << fmt; }
template <class T, class... Rest>
void format_into(std::ostringstream& out, const char* fmt, const T& value, const Rest&... rest) {
  for (; *fmt; ++fmt) {
    if (fmt[0] == '{' && fmt[1] == '}') {
      out << value;
      format_into(out, fmt + 2, rest...);
      return;
    }
    out << *fmt;
  }
}
} // namespace strata_compat
template <class... Args>
std::string format(const char* fmt, const Args&... args) {
  std::ostringstream out;
  strata_compat::format_into(out, fmt, args...);
  return out.str();
}
} // namespace std
#endif
