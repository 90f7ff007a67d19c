// Where one output tile lives in a group buffer; mirrors flashoverlap.plan.SLOT_DTYPE.
#pragma once

#include <cstdint>

namespace flashoverlap {

struct TileSlot {
  int64_t offset;  // element offset of the tile's (0, 0) in the output buffer
  int32_t ld;      // leading dimension (elements) of the tile in the output buffer
  int32_t group;   // counter index, or -1 for no signal
};
static_assert(sizeof(TileSlot) == 16, "TileSlot layout is shared with Python");

}  // namespace flashoverlap
