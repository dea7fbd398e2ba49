# mixtape_require(<Package> <debian-package> [find_package arguments...])
#
# find_package(<Package> ...) for a dependency the build cannot do without; when it is not
# found, configuring stops with one message that names the Debian 12 package to install
# (scripts/deps.sh installs all of them), instead of the find module's own list of
# variables. A macro, so that the variables and imported targets the package defines are
# visible to the caller.
macro(mixtape_require _mixtape_package _mixtape_debian)
  find_package(${_mixtape_package} ${ARGN} QUIET)
  if(NOT ${_mixtape_package}_FOUND)
    message(FATAL_ERROR
      "mixtape: ${_mixtape_package} was not found; install Debian's ${_mixtape_debian} "
      "(apt-get install ${_mixtape_debian}), or run scripts/deps.sh, which installs every "
      "package the build needs")
  endif()
endmacro()
