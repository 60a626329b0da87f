"""The committed Python stubs (pdserve/v1) are exactly what grpcio-tools makes of proto/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]


def test_stubs_match_proto_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "proto" / "pdserve" / "v1" / "generation.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "pdserve" / "v1" / name).read_text()
        committed = (ROOT / "pdserve" / "v1" / name).read_text()
        assert committed == fresh, f"pdserve/v1/{name} is stale: regenerate it (see docs/serving.md, 'The gRPC API')"


def test_proto_package_and_service():
    from pdserve.v1 import generation_pb2 as pb

    assert pb.DESCRIPTOR.package == "pdserve.v1"
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Generation"].methods}
    assert methods == {"Generate", "GetModelInfo", "GetClusterStatus"}
    assert pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name["Generate"].server_streaming
