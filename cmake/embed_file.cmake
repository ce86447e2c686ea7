# Writes OUTPUT, a C++ file defining `extern const char NAME[]` (the bytes of
# INPUT) and `extern const size_t NAME##Size`, in NAMESPACE. Run with
# cmake -DINPUT=... -DOUTPUT=... -DNAME=... -DNAMESPACE=... -P embed_file.cmake
file(READ "${INPUT}" content HEX)
string(LENGTH "${content}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${content}")
# Break the initializer into lines of 16 bytes for compilers' sake.
string(REGEX REPLACE "((('\\\\x[0-9a-f][0-9a-f]',)){16})" "\\1\n" bytes "${bytes}")
file(WRITE "${OUTPUT}.tmp"
  "// Generated from ${INPUT} by cmake/embed_file.cmake. Do not edit.\n"
  "#include <cstddef>\n"
  "namespace ${NAMESPACE} {\n"
  "extern const char ${NAME}[];\n"
  "extern const size_t ${NAME}Size;\n"
  "const char ${NAME}[] = {\n${bytes}'\\0'};\n"
  "const size_t ${NAME}Size = ${size};\n"
  "}  // namespace ${NAMESPACE}\n")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
