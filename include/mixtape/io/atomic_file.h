// Writing a file so that no reader ever sees half of it: what safetensors files (weights,
// checkpoints, whole models) and ONNX exports are written with.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace mixtape::detail {

// Where write_file_atomically's caller puts the bytes of the file, in order (buffered).
class FileSink {
 public:
  virtual ~FileSink() = default;
  virtual void write(const void* data, std::size_t n) = 0;
};

// Writes the file at `path` atomically: `fill` writes its bytes into a sink over
// `path + ".tmp-<pid>"` in the same directory, which is fsync'ed and then renamed over
// `path`. A crash never leaves a half-written file at `path`; a failure (an exception from
// `fill`, a full disk) leaves any file already there untouched and removes the temporary. A
// process killed mid-write leaves its temporary behind; the next write of the same path
// removes such stale temporaries (`path + ".tmp-<pid>"` whose process is gone; never one of a
// live process, which may be writing at the same time). Throws IOError "<format>: cannot
// write '<path>': <the system's reason>" when the file cannot be written.
void write_file_atomically(const std::string& path, std::string_view format,
                           const std::function<void(FileSink&)>& fill);

}  // namespace mixtape::detail
