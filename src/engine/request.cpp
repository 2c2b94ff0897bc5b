// engine/request.cpp: the one function of request.h (no libtorch: the fuzz targets link it too).
#include "engine/request.h"

namespace lorasync::engine {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
    case FinishReason::kNone: break;
  }
  return nullptr;
}

}  // namespace lorasync::engine
