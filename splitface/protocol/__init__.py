"""splitface wire protocol: numpy + msgpack only (the Android app mirrors it). See SPEC.md."""
from splitface.protocol.client_session import ClientSession
from splitface.protocol.errors import ErrorCode, ProtocolError, RemoteError
from splitface.protocol.messages import PROTOCOL_VERSION, decode, encode
from splitface.protocol.server_session import DeviceRecord, ServerInfo, ServerSession
from splitface.protocol.tensor import ENCODINGS, decode_tensor, encode_tensor

__all__ = [
    "ErrorCode", "ProtocolError", "RemoteError", "PROTOCOL_VERSION", "decode", "encode",
    "ClientSession", "DeviceRecord", "ServerInfo", "ServerSession", "ENCODINGS", "decode_tensor", "encode_tensor",
]
