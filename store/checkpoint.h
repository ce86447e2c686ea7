// Checkpoint files: one named blob per file, replaced atomically.
//
//   <dir>/<name>.ckpt = "FSHKCKP1" | crc32c u32 | length u64 | bytes
//
// (integers little-endian; the CRC covers the length and the bytes.) A write
// goes to <name>.ckpt.tmp, is fsynced, renamed over the old file and the
// directory is fsynced: a reader sees the old checkpoint or the new one,
// never a mix, even across a crash.
#pragma once

#include <string>
#include <string_view>

namespace foreshock::store {

bool WriteCheckpointFile(const std::string& dir, std::string_view name, std::string_view bytes,
                         std::string* error);

enum class CheckpointStatus { kOk, kMissing, kCorrupt, kIoError };

// On kCorrupt and kIoError, *error says why.
CheckpointStatus ReadCheckpointFile(const std::string& dir, std::string_view name,
                                    std::string* bytes, std::string* error);

std::string CheckpointPath(const std::string& dir, std::string_view name);

}  // namespace foreshock::store
