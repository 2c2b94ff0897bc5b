# lorasync_set_warnings(target): the project's warning set (clean under g++ 12 and clang 14).
function(lorasync_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow=local
                         -Wnon-virtual-dtor -Wno-unused-parameter -Wno-missing-field-initializers)
  if(LORASYNC_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
