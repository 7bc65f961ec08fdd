# The library's boundary (docs/architecture.md: the library owns the domain; the tool owns the
# flags): the tool (apps/), the Python extension (python/src/) and the examples (examples/) use
# the library's public API only. Fails, listing each offending line as file:line: text, on any
# use of a `detail::` namespace there; lines that are only a comment are not looked at.
#   cmake [-DSOURCE_DIR=<repository>] -P tests/library_boundary.cmake
if(NOT SOURCE_DIR)
  get_filename_component(SOURCE_DIR "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
endif()

set(offending "")
set(checked 0)
foreach(dir apps python/src examples)
  file(GLOB_RECURSE files LIST_DIRECTORIES false "${SOURCE_DIR}/${dir}/*")
  list(SORT files)
  foreach(file IN LISTS files)
    if(NOT file MATCHES "\\.(c|cc|cpp|cxx|h|hh|hpp|hxx|cu|cuh|inl|ipp)$")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    file(READ "${file}" text)
    if(NOT text MATCHES "(^|[^A-Za-z0-9_])detail::")
      continue()
    endif()
    # One list element per line: a ';' would split a line, and '[' or ']' join lines.
    string(REPLACE ";" "@SEMICOLON@" text "${text}")
    string(REPLACE "[" "@LBRACKET@" text "${text}")
    string(REPLACE "]" "@RBRACKET@" text "${text}")
    string(REPLACE "\n" ";" lines "${text}")
    file(RELATIVE_PATH rel "${SOURCE_DIR}" "${file}")
    set(number 0)
    foreach(line IN LISTS lines)
      math(EXPR number "${number} + 1")
      if(line MATCHES "^[ \t]*(//|/\\*|\\*)")
        continue()
      endif()
      if(line MATCHES "(^|[^A-Za-z0-9_])detail::")
        string(REPLACE "@SEMICOLON@" ";" line "${line}")
        string(REPLACE "@LBRACKET@" "[" line "${line}")
        string(REPLACE "@RBRACKET@" "]" line "${line}")
        string(STRIP "${line}" line)
        string(APPEND offending "  ${rel}:${number}: ${line}\n")
      endif()
    endforeach()
  endforeach()
endforeach()

if(checked EQUAL 0)
  message(FATAL_ERROR "library_boundary: no source files under ${SOURCE_DIR}/{apps,python/src,examples}")
endif()
if(offending)
  message(FATAL_ERROR
          "library_boundary: the tool, the Python extension and the examples must use the "
          "library's public API only; these lines use a detail:: namespace (make what they need "
          "public, with a doc comment, in the library header where it belongs):\n${offending}")
endif()
message(STATUS "library_boundary: ${checked} files, no detail:: outside the library")
