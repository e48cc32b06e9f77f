# Finds LibTorch. It ships inside Python's `torch` wheel; its CMake package lives at
# `torch.utils.cmake_prefix_path`. When the caller gave no Torch_DIR / prefix path, ask the
# project's Python (DIFFTRAIN_PYTHON, else the venv scripts/setup.sh makes, else python3).

function(difftrain_default_python out)
  if(DEFINED ENV{DIFFTRAIN_VENV} AND EXISTS "$ENV{DIFFTRAIN_VENV}/bin/python")
    set(${out} "$ENV{DIFFTRAIN_VENV}/bin/python" PARENT_SCOPE)
  elseif(EXISTS "$ENV{HOME}/.cache/difftrain/venv/bin/python")
    set(${out} "$ENV{HOME}/.cache/difftrain/venv/bin/python" PARENT_SCOPE)
  else()
    find_program(_difftrain_python3 NAMES python3 python)
    set(${out} "${_difftrain_python3}" PARENT_SCOPE)
  endif()
endfunction()

macro(difftrain_locate_torch)
  if(NOT DIFFTRAIN_PYTHON)
    difftrain_default_python(_difftrain_py)
    set(DIFFTRAIN_PYTHON "${_difftrain_py}" CACHE FILEPATH
        "Python interpreter whose torch package provides LibTorch and the reference libraries")
  endif()
  if(NOT Torch_DIR)
    execute_process(
      COMMAND "${DIFFTRAIN_PYTHON}" -c "import sys, torch; sys.stdout.write(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _difftrain_torch_prefix
      RESULT_VARIABLE _difftrain_torch_rc
      ERROR_QUIET)
    if(_difftrain_torch_rc EQUAL 0)
      list(APPEND CMAKE_PREFIX_PATH "${_difftrain_torch_prefix}")
    endif()
  endif()
  find_package(Torch QUIET)
  if(NOT Torch_FOUND)
    message(FATAL_ERROR
      "difftrain: LibTorch not found (asked ${DIFFTRAIN_PYTHON}). Pass "
      "-DTorch_DIR=<torch.utils.cmake_prefix_path>/Torch or -DDIFFTRAIN_PYTHON=<a python with "
      "torch>; in difftrain's checkout, `bash scripts/setup.sh` installs torch into a venv.")
  endif()
endmacro()
