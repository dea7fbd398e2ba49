// Checks of the files named on the bundled apps' command lines, made before anything is
// loaded or trained: a run that would fail at its end fails at once instead.
#pragma once

#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "mixtape/core/error.h"

namespace apps {

// Checks that `path`, the value of `flag`, can be written: it is not a directory, and its
// directory exists and takes a new file (a probe file is created there and removed at once:
// nothing is left behind, and an existing file is not touched). A file written in place (the
// metrics) must also be writable itself when it exists; the others are written to a
// temporary file and renamed over it.
inline void check_writable(const std::string& flag, const std::string& path, bool in_place) {
  namespace fs = std::filesystem;
  auto refuse = [&](const std::string& why) {
    throw mixtape::IOError(fmt::format("{}: cannot write '{}': {}", flag, path, why));
  };
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) refuse("it is a directory; give the path of a file");
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const fs::file_status st = fs::status(dir, ec);
  if (st.type() == fs::file_type::not_found)
    refuse(fmt::format("the directory '{}' does not exist", dir.string()));
  if (!fs::is_directory(st)) refuse(fmt::format("'{}' is not a directory", dir.string()));
  std::string probe = (dir / ".mixtape-probe-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0)
    refuse(fmt::format("cannot create a file in '{}': {}", dir.string(), std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
  if (in_place && fs::exists(p, ec) && ::access(path.c_str(), W_OK) != 0)
    refuse(std::strerror(errno));
}

}  // namespace apps
