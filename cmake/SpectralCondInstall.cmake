include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS spectral_cond EXPORT spectral_condTargets)
if(TARGET spectral_cond_io)
  install(TARGETS spectral_cond_io EXPORT spectral_condTargets)
endif()
# The CUDA path (docs/cuda.md) is installed whole or not at all: with SPECTRAL_COND_ENABLE_CUDA
# its static library spectral_cond::cuda and the headers include/spectral_cond/cuda/ (api.hpp for
# host code, the .cuh templates for nvcc code); without it neither, since the headers declare
# functions that only that library defines.
if(TARGET spectral_cond_cuda)
  install(TARGETS spectral_cond_cuda EXPORT spectral_condTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  set(_sc_cuda_headers)
else()
  set(_sc_cuda_headers PATTERN cuda EXCLUDE)
endif()
install(DIRECTORY include/spectral_cond DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${_sc_cuda_headers})
install(EXPORT spectral_condTargets NAMESPACE spectral_cond::
        DESTINATION ${CMAKE_INSTALL_DATADIR}/spectral_cond/cmake)
configure_package_config_file(cmake/spectral_condConfig.cmake.in
  ${PROJECT_BINARY_DIR}/spectral_condConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_DATADIR}/spectral_cond/cmake)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/spectral_condConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/spectral_condConfig.cmake
              ${PROJECT_BINARY_DIR}/spectral_condConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_DATADIR}/spectral_cond/cmake)
