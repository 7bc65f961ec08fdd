# Strict warnings and optional sanitizers for the project's own targets only (never global).
function(spectral_cond_target_defaults target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion)
    if(SPECTRAL_COND_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
    if(SPECTRAL_COND_SANITIZE)
      target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                               -fno-sanitize-recover=undefined)
      target_link_options(${target} PRIVATE -fsanitize=address,undefined)
    endif()
  endif()
endfunction()
