// IDX files, the format of MNIST and Fashion-MNIST: reading (raw or gzip-compressed, the
// compression detected by the file's magic bytes) with full validation of the header and
// the size, and writing (uint8 and the other IDX element types).
//
// An IDX file is a 4-byte magic number (two zero bytes, an element type code, the rank),
// one big-endian uint32 extent per dimension, then the elements in row-major order,
// big-endian. Every error is a mixtape::IOError whose one-line message names the file
// and what is wrong with it.
//
// The readers open regular files only (a symbolic link to one is fine): a directory, a FIFO
// (which would block the reader), a device (/dev/zero would feed it without end) or a socket
// is refused before it is opened for reading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "mixtape/core/dtype.h"
#include "mixtape/core/shape.h"
#include "mixtape/core/tensor.h"

namespace mixtape::datasets {

// The element type codes of IDX (the third byte of the magic number).
enum class IdxType : std::uint8_t {
  UInt8 = 0x08,    // read as uint8
  Int8 = 0x09,     // read as int32 (mixtape has no int8 dtype)
  Int16 = 0x0B,    // read as int32 (mixtape has no int16 dtype)
  Int32 = 0x0C,    // int32
  Float32 = 0x0D,  // float32
  Float64 = 0x0E,  // float64
};

// Streams the decompressed content of a file to `sink`, in chunks, in order. A file that
// starts with the gzip magic bytes (1f 8b) is inflated, whatever its name (concatenated
// gzip members are read one after the other); any other file is passed through as is.
// Throws IOError naming `path` when it is not a regular file or cannot be opened or read,
// and on a corrupt or truncated gzip stream or bytes after its end. Memory stays constant
// (one chunk); the sink may throw to stop reading.
void read_decompressed(const std::filesystem::path& path,
                       const std::function<void(const std::uint8_t*, std::size_t)>& sink);
// The whole decompressed content of a file (see above).
std::vector<std::uint8_t> read_decompressed(const std::filesystem::path& path);

// The header of an IDX file, as read_idx() reads it before any data.
struct IdxHeader {
  IdxType type = IdxType::UInt8;  // the element type code
  DType dtype = kUInt8;           // the dtype read_idx() gives the elements
  Shape shape = {};               // the extents, in order
  std::uint64_t data_bytes = 0;   // the bytes of data it promises (extents x item size)
};

// A caller's check of the header, run by read_idx() before any data is read. It throws (an
// IOError naming the file) to refuse a file whose type or shape is not what the caller
// reads, or whose promise is larger than it accepts (MNIST's loaders refuse an image file
// that is not [N, 28, 28] or holds more images than there are labels): such a file is then
// refused without reading its data.
using IdxHeaderCheck = std::function<void(const IdxHeader&)>;

// Reads an IDX file (raw or gzip) into a new CPU tensor of the file's shape: uint8 for
// type 0x08, int32 for 0x09/0x0B/0x0C (widened), float32 for 0x0D, float64 for 0x0E.
// Validates the magic number, the element type, the rank (1 to 4), and that the file
// holds exactly the bytes its header promises; throws IOError otherwise. `check`, when
// given, sees the header first (see IdxHeaderCheck).
//
// The data read is bounded by the header's promise: a promise larger than the file can
// hold (a raw file's size; 1032 times a gzip file's size, deflate's largest expansion) is
// refused before reading, memory grows with the bytes actually read (in 16 MiB pieces),
// and reading stops at the first byte past the promise (a gzip "bomb" is never inflated
// beyond it).
Tensor read_idx(const std::filesystem::path& path, const IdxHeaderCheck& check = {});

// Writes `tensor` (rank 1 to 4; uint8, int32, float32 or float64, each written as the
// matching IDX type) as an IDX file, gzip-compressed when `gzip` is true. The file is
// written to a temporary name beside `path` and renamed into place, so a reader never
// sees a half-written file. Throws DTypeError/ShapeError for a tensor IDX cannot hold
// and IOError when writing fails.
void write_idx(const std::filesystem::path& path, const Tensor& tensor, bool gzip = false);

}  // namespace mixtape::datasets
