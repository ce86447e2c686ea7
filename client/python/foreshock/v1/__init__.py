"""Generated stubs of the foreshock.v1 wire contract (ingest_pb2, ingest_pb2_grpc).

They are build outputs of proto/foreshock/v1/ingest.proto: CMake or setup.py
generates them; they are not kept in git.
"""
