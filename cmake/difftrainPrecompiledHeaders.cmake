# difftrain_precompile_headers(<target> [HEADERS <header>...] [REUSE_FROM <other-target>])
#
# Precompiles the headers a difftrain user's translation units spend their time in: LibTorch's
# tensor, module and optimizer headers, and the difftrain headers named (by default the trainer,
# `difftrain/train/trainer.hpp`, which brings the optimizers, schedules, EMA, precision and
# callbacks). Every source of <target> then starts from the parsed headers instead of parsing
# them again. With REUSE_FROM, <target> uses <other-target>'s precompiled header (same compiler
# flags needed), so a project with several executables builds it once.
#
# Off when DIFFTRAIN_PRECOMPILED_HEADERS is OFF (the switch for a build that must not use them,
# for instance with a compiler cache not set up for precompiled headers).
option(DIFFTRAIN_PRECOMPILED_HEADERS "Precompile difftrain's and LibTorch's headers in targets that call difftrain_precompile_headers()" ON)

function(difftrain_precompile_headers target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "REUSE_FROM" "HEADERS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "difftrain_precompile_headers(${target}): unknown arguments ${arg_UNPARSED_ARGUMENTS} "
                        "(HEADERS <header>... or REUSE_FROM <target>)")
  endif()
  if(NOT TARGET ${target})
    message(FATAL_ERROR "difftrain_precompile_headers: '${target}' is not a target")
  endif()
  if(NOT DIFFTRAIN_PRECOMPILED_HEADERS)
    return()
  endif()
  if(arg_REUSE_FROM)
    if(arg_HEADERS)
      message(FATAL_ERROR "difftrain_precompile_headers(${target}): REUSE_FROM takes the other "
                          "target's headers; give HEADERS there")
    endif()
    target_precompile_headers(${target} REUSE_FROM ${arg_REUSE_FROM})
    return()
  endif()
  if(NOT arg_HEADERS)
    set(arg_HEADERS difftrain/train/trainer.hpp)
  endif()
  set(bracketed "")
  foreach(h IN LISTS arg_HEADERS)
    list(APPEND bracketed "<${h}>")
  endforeach()
  target_precompile_headers(${target} PRIVATE
    <ATen/ATen.h> <torch/nn/module.h> <torch/optim/optimizer.h> <nlohmann/json.hpp>
    ${bracketed})
endfunction()
