# LORASYNC_SANITIZE=address,undefined | thread: applied to every target of the project.
if(LORASYNC_SANITIZE)
  string(REPLACE "," ";" _san "${LORASYNC_SANITIZE}")
  foreach(s IN LISTS _san)
    add_compile_options(-fsanitize=${s})
    add_link_options(-fsanitize=${s})
  endforeach()
  add_compile_options(-fno-omit-frame-pointer)
endif()
