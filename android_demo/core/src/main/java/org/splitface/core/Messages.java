package org.splitface.core;

import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.Predicate;

/** Message types and their fields (splitface/protocol/messages.py), decoding with the SPEC's validation order. */
public final class Messages {
    private Messages() {}

    public static final int PROTOCOL_VERSION = 1;
    public static final long DEFAULT_MAX_MESSAGE_BYTES = 1L << 30;
    public static final String HELLO = "hello", WELCOME = "welcome", ERROR = "error", FORWARD = "forward",
            BACKWARD = "backward", EMBEDDINGS = "embeddings", EMBEDDING_GRAD = "embedding_grad", EVAL_RESULT = "eval_result";
    /** U-shaped split (SPEC.md section 8.1): PrivacyFace's sanitised clusters, relayed between device heads. */
    public static final String CLUSTERS = "clusters";
    /** U-shaped split, opt-in (SPEC.md section 8.2): FedGC's correction of the device head's class embeddings. */
    public static final String CLASS_EMBEDDINGS = "class_embeddings";

    private static final Predicate<Object> TENSOR = v -> true;

    private record Field(Predicate<Object> check, boolean required) {}

    static boolean isInt(Object v) { return v instanceof Long || v instanceof BigInteger; }
    static boolean isNumber(Object v) { return isInt(v) || v instanceof Double; }
    static boolean intAtLeast(Object v, long min) {
        return v instanceof Long ? (Long) v >= min : v instanceof BigInteger && ((BigInteger) v).compareTo(BigInteger.valueOf(min)) >= 0;
    }
    static boolean isIntList(Object v) { return v instanceof List && ((List<?>) v).stream().allMatch(Messages::isInt); }
    static boolean isStr(Object v) { return v instanceof String; }
    /** spent_epsilon (SPEC.md section 5.11): a finite number >= 0. */
    static boolean isSpentEpsilon(Object v) {
        return isNumber(v) && Double.isFinite(((Number) v).doubleValue()) && ((Number) v).doubleValue() >= 0;
    }

    private static final Map<String, Map<String, Field>> SCHEMA = new LinkedHashMap<>();

    private static void type(String name, Object... fields) {
        Map<String, Field> f = new LinkedHashMap<>();
        for (int i = 0; i < fields.length; i += 3) {
            @SuppressWarnings("unchecked") Predicate<Object> check = (Predicate<Object>) fields[i + 1];
            f.put((String) fields[i], new Field(check, (Boolean) fields[i + 2]));
        }
        SCHEMA.put(name, f);
    }

    static {
        Predicate<Object> bool = v -> v instanceof Boolean;
        type(HELLO,
                "protocol_version", (Predicate<Object>) Messages::isInt, true,
                "device_id", (Predicate<Object>) v -> isStr(v) && !((String) v).isEmpty() && ((String) v).length() <= 128, true,
                "token", (Predicate<Object>) v -> isStr(v) && ((String) v).length() <= 256, true,
                "model", (Predicate<Object>) v -> v instanceof Map, true,
                "split", (Predicate<Object>) Messages::isStr, true,
                "head", (Predicate<Object>) Messages::isStr, true,
                "encodings", (Predicate<Object>) v -> v instanceof Map && ((Map<?, ?>) v).values().stream().allMatch(Messages::isStr), true,
                "batch_size", (Predicate<Object>) v -> intAtLeast(v, 1), true,
                "num_classes", (Predicate<Object>) v -> intAtLeast(v, 1), false);
        type(WELCOME,
                "session_id", (Predicate<Object>) Messages::isStr, true,
                "resume_from", (Predicate<Object>) v -> intAtLeast(v, 1), true,
                "durable_through", (Predicate<Object>) v -> intAtLeast(v, 0), true,
                "activation_shape", (Predicate<Object>) Messages::isIntList, true,
                "embedding_dim", (Predicate<Object>) Messages::isInt, true,
                "limits", (Predicate<Object>) v -> v instanceof Map, true,
                "spent_epsilon", (Predicate<Object>) Messages::isSpentEpsilon, false);
        type(ERROR,
                "code", (Predicate<Object>) Messages::isStr, true,
                "message", (Predicate<Object>) Messages::isStr, true,
                "batch_id", (Predicate<Object>) Messages::isInt, false);
        type(FORWARD,
                "batch_id", (Predicate<Object>) v -> intAtLeast(v, 0), true,
                "activations", TENSOR, true,
                "visible", (Predicate<Object>) Patches::isVisibleField, false,   // the packed form, SPEC.md 5.12
                "labels", (Predicate<Object>) Messages::isIntList, false,
                "eval", bool, false,
                "spent_epsilon", (Predicate<Object>) Messages::isSpentEpsilon, false);
        type(BACKWARD,
                "batch_id", (Predicate<Object>) Messages::isInt, true,
                "grad", TENSOR, true,
                "loss", (Predicate<Object>) Messages::isNumber, false,
                "n_correct", (Predicate<Object>) Messages::isInt, false,
                "server_s", (Predicate<Object>) v -> isNumber(v) && ((Number) v).doubleValue() >= 0, false,
                "durable_through", (Predicate<Object>) v -> intAtLeast(v, 0), true);
        type(EMBEDDINGS,
                "batch_id", (Predicate<Object>) Messages::isInt, true,
                "embeddings", TENSOR, true,
                "eval", bool, false,
                "server_s", (Predicate<Object>) v -> isNumber(v) && ((Number) v).doubleValue() >= 0, false);
        type(EMBEDDING_GRAD,
                "batch_id", (Predicate<Object>) v -> intAtLeast(v, 1), true,
                "grad", TENSOR, true);
        type(EVAL_RESULT,
                "batch_id", (Predicate<Object>) Messages::isInt, true,
                "loss", (Predicate<Object>) Messages::isNumber, true,
                "n_correct", (Predicate<Object>) Messages::isInt, true,
                "n", (Predicate<Object>) Messages::isInt, true);
        type(CLUSTERS,
                "clusters", TENSOR, true);
        type(CLASS_EMBEDDINGS,
                "class_embeddings", TENSOR, true);
    }

    /** A validated message: fields in wire order, tensor fields as {@link Tensor}. */
    @SuppressWarnings("unchecked")
    public static Map<String, Object> decode(byte[] data, long maxSize) {
        if (data.length > maxSize)
            throw new ProtocolException(ProtocolException.TOO_LARGE, "message of " + data.length + " bytes exceeds the limit of " + maxSize);
        Object obj = Wire.unpack(data);
        if (!(obj instanceof Map) || !(((Map<?, ?>) obj).get("type") instanceof String))
            throw new ProtocolException(ProtocolException.BAD_MESSAGE, "a message must be a map with a string `type`");
        Map<String, Object> msg = (Map<String, Object>) obj;
        String type = (String) msg.get("type");
        Map<String, Field> schema = SCHEMA.get(type);
        if (schema == null) throw new ProtocolException(ProtocolException.UNKNOWN_TYPE, "unknown message type '" + type + "'");
        Long batchId = msg.get("batch_id") instanceof Long ? (Long) msg.get("batch_id") : null;
        for (String key : msg.keySet())
            if (!key.equals("type") && !schema.containsKey(key))
                throw new ProtocolException(ProtocolException.BAD_MESSAGE, type + ": unexpected field " + key, batchId);
        for (Map.Entry<String, Field> e : schema.entrySet()) {
            String name = e.getKey();
            if (!msg.containsKey(name)) {
                if (e.getValue().required()) throw new ProtocolException(ProtocolException.BAD_MESSAGE, type + ": missing field '" + name + "'", batchId);
                continue;
            }
            if (e.getValue().check() == TENSOR) {
                try {
                    msg.put(name, Tensor.fromWire(msg.get(name), name));
                } catch (ProtocolException ex) {
                    throw new ProtocolException(ex.code, type + ": " + ex.getMessage(), batchId);
                }
            } else if (!e.getValue().check().test(msg.get(name))) {
                throw new ProtocolException(ProtocolException.BAD_MESSAGE, type + ": field '" + name + "' has a wrong type or value", batchId);
            }
        }
        if (FORWARD.equals(type) && msg.containsKey("visible")) {
            try {
                Patches.check((Tensor) msg.get("activations"), (Map<?, ?>) msg.get("visible"));
            } catch (ProtocolException ex) {
                throw new ProtocolException(ex.code, type + ": " + ex.getMessage(), batchId);
            }
        }
        return msg;
    }

    public static byte[] encode(Map<String, Object> message) {
        if (!SCHEMA.containsKey(message.get("type"))) throw new IllegalArgumentException("cannot encode unknown message type " + message.get("type"));
        return Wire.pack(message);
    }

    public static Map<String, Object> message(String type) {
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("type", type);
        return m;
    }
}
