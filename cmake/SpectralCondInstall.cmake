include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS spectral_cond EXPORT spectral_condTargets)
if(TARGET spectral_cond_io)
  install(TARGETS spectral_cond_io EXPORT spectral_condTargets)
endif()
install(DIRECTORY include/spectral_cond DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
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
