// What a file that is not a regular file is, for the messages of the IDX reader and the
// dataset loaders ("is a FIFO (named pipe), not a regular file"). Private to the library.
#pragma once

#include <sys/stat.h>

#include <string>

namespace mixtape::datasets {

inline std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

}  // namespace mixtape::datasets
