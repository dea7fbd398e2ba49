// Downloads with libcurl, in-process, private to the library: the dataset loaders fetch
// single files into the cache and npm metadata and tarballs into memory with them.
// http://, https:// and file:// URLs; redirects are followed (to http(s) only); proxies
// come from the usual environment variables (https_proxy, no_proxy, ...), as for curl.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <utility>

#include "mixtape/core/error.h"

namespace mixtape::datasets {

struct Timeouts {
  int connect_s = 10;    // to reach the host (libcurl's CURLOPT_CONNECTTIMEOUT)
  int transfer_s = 600;  // the whole transfer (CURLOPT_TIMEOUT)
};

// A download that failed: the message names the URL's problem as libcurl reports it
// ("libcurl: (6) Could not resolve host: example.org", "libcurl: (22) The requested URL
// returned error: 404", ...).
class DownloadError : public IOError {
 public:
  enum class Scope {
    Url,   // this URL only (HTTP 404, a missing file://, a body too large, ...)
    Host,  // every URL of the host would fail the same way (not resolved, not reached,
           // timed out, TLS refused)
  };
  DownloadError(const std::string& what, Scope scope, std::string host_problem = {})
      : IOError(what), scope_(scope), host_problem_(std::move(host_problem)) {}
  Scope scope() const { return scope_; }
  // For Scope::Host: what is wrong with the host ("the host is unreachable", "TLS with
  // the host failed").
  const std::string& host_problem() const { return host_problem_; }

 private:
  Scope scope_;
  std::string host_problem_;
};

// Downloads `url` into the file `out` (created, or truncated). Throws DownloadError; the
// file may then hold part of the body (callers write to a temporary name and remove it).
void download_to_file(const std::string& url, const std::filesystem::path& out,
                      const Timeouts& timeouts);

// Downloads `url` into memory; a body larger than `max_bytes` is refused (DownloadError).
std::string download_to_memory(const std::string& url, const Timeouts& timeouts,
                               std::size_t max_bytes);

}  // namespace mixtape::datasets
