// safetensors: reading and writing files in the format of Hugging Face's safetensors
// library, byte for byte (the Python library reads our files and we read its files).
//
//   mt::save_safetensors("w.safetensors", {{"w", w}, {"b", b}}, {{"author", "me"}});
//   mt::SafetensorsFile f = mt::load_safetensors("w.safetensors");
//   mt::Tensor w2 = f.at("w");
//
// The layout: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON (the header,
// padded with spaces to a multiple of 8 bytes)
//   {"__metadata__":{"key":"value"},"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}
// then the raw little-endian, row-major data of every tensor, back to back, with offsets
// relative to the start of the data. dtype codes: F64, F32, F16, BF16, I64, I32, U8, BOOL.
// Tensors are written the way the safetensors library writes them: sorted by decreasing
// alignment (8-, then 4-, 2- and 1-byte dtypes; within a size in the library's order
// I64, F64 / F32, I32 / BF16, F16 / U8, BOOL), then by name (byte-wise), so that every
// tensor's data is aligned to its element size and the same tensors always give the same
// bytes. docs/checkpoints.md has the details.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/core/tensor.h"

namespace mixtape {

// Writes `tensors` (any device, any strides: they are copied to the host in row-major
// order) and `metadata` (the header's "__metadata__", left out when empty) to `path`,
// atomically: the bytes go to `path + ".tmp-<pid>"` in the same directory, which is
// fsync'ed and then renamed over `path`. A crash never leaves a half-written file at
// `path`, and a failed save leaves any file already there untouched and removes its
// temporary file. A process killed mid-save leaves its temporary behind; the next save of
// the same path removes such stale temporaries (`path + ".tmp-<pid>"` whose process is
// gone; never one of a live process, which may be saving at the same time). Throws ValueError for
// an undefined tensor, a duplicate or reserved name
// ("__metadata__") or a name or metadata text that is not valid UTF-8, and IOError (naming
// the path and the system's reason) when the file cannot be written.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The contents of a safetensors file: its tensors (on the CPU, in the order of their data
// in the file, which for files written by mixtape or the safetensors library is the order
// of the header) and its metadata.
struct SafetensorsFile {
  std::vector<std::pair<std::string, Tensor>> tensors = {};
  std::map<std::string, std::string> metadata = {};

  // The tensor called `name`; throws ValueError when there is none.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
};

// Reads a safetensors file whole. Throws IOError when the file cannot be read (naming the
// path and the system's reason) and when it is corrupt: a one-line message naming the
// file and the problem (a header length that is too short or runs past the file, JSON
// that is malformed or not of the format's shape, an unknown dtype, data_offsets that do
// not match the shape, tensors that overlap or leave a hole between them, data that runs
// past the end of the file or bytes after the last tensor, a name given twice).
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace mixtape
