package org.splitface.core;

import java.io.IOException;
import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.msgpack.core.MessageBufferPacker;
import org.msgpack.core.MessageFormat;
import org.msgpack.core.MessagePack;
import org.msgpack.core.MessageUnpacker;

/**
 * msgpack to plain Java values and back, in the forms the Python reference produces: maps keep
 * their key order (LinkedHashMap), ints are Long, floats Double (always written as float64), str
 * is String, bin is byte[]. Decoding then encoding a reference message gives the same bytes.
 */
public final class Wire {
    private Wire() {}

    /** Exactly one msgpack object, or BAD_MESSAGE. */
    public static Object unpack(byte[] data) {
        try (MessageUnpacker u = MessagePack.newDefaultUnpacker(data)) {
            if (!u.hasNext()) throw new ProtocolException(ProtocolException.BAD_MESSAGE, "not a msgpack message: empty");
            Object value = read(u);
            if (u.hasNext()) throw new ProtocolException(ProtocolException.BAD_MESSAGE, "not a msgpack message: extra data");
            return value;
        } catch (IOException | RuntimeException e) {
            if (e instanceof ProtocolException) throw (ProtocolException) e;
            throw new ProtocolException(ProtocolException.BAD_MESSAGE, "not a msgpack message: " + e.getMessage());
        }
    }

    private static Object read(MessageUnpacker u) throws IOException {
        MessageFormat f = u.getNextFormat();
        switch (f.getValueType()) {
            case NIL: u.unpackNil(); return null;
            case BOOLEAN: return u.unpackBoolean();
            case INTEGER:
                if (f == MessageFormat.UINT64) {
                    BigInteger big = u.unpackBigInteger();
                    return big.bitLength() < 64 ? (Object) big.longValue() : big;
                }
                return u.unpackLong();
            case FLOAT: return u.unpackDouble();
            case STRING: return u.unpackString();
            case BINARY: return u.readPayload(u.unpackBinaryHeader());
            case ARRAY: {
                int n = u.unpackArrayHeader();
                List<Object> list = new ArrayList<>(n);
                for (int i = 0; i < n; i++) list.add(read(u));
                return list;
            }
            case MAP: {
                int n = u.unpackMapHeader();
                Map<String, Object> map = new LinkedHashMap<>();
                for (int i = 0; i < n; i++) {
                    Object key = read(u);
                    if (!(key instanceof String)) throw new ProtocolException(ProtocolException.BAD_MESSAGE, "map keys must be strings");
                    map.put((String) key, read(u));
                }
                return map;
            }
            default: throw new ProtocolException(ProtocolException.BAD_MESSAGE, "unsupported msgpack type " + f);
        }
    }

    public static byte[] pack(Object value) {
        try (MessageBufferPacker p = MessagePack.newDefaultBufferPacker()) {
            write(p, value);
            return p.toByteArray();
        } catch (IOException e) {
            throw new IllegalStateException(e);
        }
    }

    @SuppressWarnings("unchecked")
    private static void write(MessageBufferPacker p, Object v) throws IOException {
        if (v == null) p.packNil();
        else if (v instanceof Boolean) p.packBoolean((Boolean) v);
        else if (v instanceof Integer || v instanceof Long) p.packLong(((Number) v).longValue());
        else if (v instanceof BigInteger) p.packBigInteger((BigInteger) v);
        else if (v instanceof Float || v instanceof Double) p.packDouble(((Number) v).doubleValue());
        else if (v instanceof String) p.packString((String) v);
        else if (v instanceof byte[]) { byte[] b = (byte[]) v; p.packBinaryHeader(b.length); p.writePayload(b); }
        else if (v instanceof Tensor) write(p, ((Tensor) v).toWire());
        else if (v instanceof List) {
            List<Object> list = (List<Object>) v;
            p.packArrayHeader(list.size());
            for (Object x : list) write(p, x);
        } else if (v instanceof Map) {
            Map<String, Object> map = (Map<String, Object>) v;
            p.packMapHeader(map.size());
            for (Map.Entry<String, Object> e : map.entrySet()) { p.packString(e.getKey()); write(p, e.getValue()); }
        } else throw new IllegalArgumentException("cannot pack " + v.getClass());
    }
}
