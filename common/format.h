#pragma once

// Human-readable numbers for tables: decimal units, three significant figures.

#include <string>

#include "absl/strings/string_view.h"

namespace zeroshard {

// 120000000000 -> "120 GB", 31406250000 -> "31.4 GB", 1875000000 -> "1.88 GB",
// 512 -> "512 B". Decimal (SI) units, three significant figures.
std::string FormatBytes(double bytes);
// 7.5e9 -> "7.50B", 1.4e7 -> "14.0M", 128e9 -> "128B" (parameter counts).
std::string FormatCount(double count);
// Three significant figures, no unit.
std::string FormatSig3(double value);
// Pads to `width` characters (UTF-8 code points, so "Ψ" counts as one).
std::string PadRight(absl::string_view s, size_t width);
std::string PadLeft(absl::string_view s, size_t width);

}  // namespace zeroshard
