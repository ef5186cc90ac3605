# Compiler, warnings, sanitizers, ccache, link parallelism.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(CMAKE_C_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()

# 2-core machines: never run two links at once (they are the memory peak).
set_property(GLOBAL PROPERTY JOB_POOLS link_pool=1)
set(CMAKE_JOB_POOL_LINK link_pool)

option(GPUAAS_WERROR "Treat warnings as errors" ON)
option(GPUAAS_SANITIZE "Build with AddressSanitizer + UndefinedBehaviorSanitizer" OFF)

add_library(gpuaas_warnings INTERFACE)
target_compile_options(gpuaas_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow
  -Wnon-virtual-dtor -Wcast-align -Wunused -Woverloaded-virtual
  -Wimplicit-fallthrough)
if(GPUAAS_WERROR)
  target_compile_options(gpuaas_warnings INTERFACE -Werror)
endif()

if(GPUAAS_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
  # GCC 12 + ASan reports -Wmaybe-uninitialized inside libstdc++'s <regex> (a known false
  # positive); keep every other warning an error.
  target_compile_options(gpuaas_warnings INTERFACE -Wno-maybe-uninitialized)
endif()
