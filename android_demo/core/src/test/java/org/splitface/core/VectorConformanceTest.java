package org.splitface.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;
import org.junit.Test;

/** splitface/protocol/vectors: every valid case decodes to its JSON and re-encodes byte for byte; every invalid one is refused with its code. */
public class VectorConformanceTest {
    static final Path VECTORS = Path.of(System.getProperty("splitface.vectors", "../splitface/protocol/vectors"));

    static List<Path> cases(Path dir) throws Exception {
        try (var files = Files.list(dir)) {
            return files.filter(p -> p.toString().endsWith(".json")).sorted().collect(Collectors.toList());
        }
    }

    @SuppressWarnings("unchecked")
    static Object meaning(Object json) {
        if (json instanceof Map) {
            Map<String, Object> m = (Map<String, Object>) json;
            Map<String, Object> out = new LinkedHashMap<>();
            for (Map.Entry<String, Object> e : m.entrySet()) {
                if (m.containsKey("data_hex")) {                       // a tensor: its wire form
                    if (e.getKey().equals("values")) continue;
                    if (e.getKey().equals("data_hex")) { out.put("data", HexFormat.of().parseHex((String) e.getValue())); continue; }
                }
                if (e.getKey().equals("scales_hex")) { out.put("scales", HexFormat.of().parseHex((String) e.getValue())); continue; }
                if (e.getKey().equals("bits_hex")) { out.put("bits", HexFormat.of().parseHex((String) e.getValue())); continue; }
                out.put(e.getKey(), meaning(e.getValue()));
            }
            return out;
        }
        if (json instanceof List) {
            List<Object> out = new ArrayList<>();
            for (Object x : (List<Object>) json) out.add(meaning(x));
            return out;
        }
        return json;
    }

    @Test
    public void everyVector() throws Exception {
        int[] counts = conform(VECTORS);
        assertTrue(counts[0] >= 16 && counts[1] >= 15 && counts[2] >= 1);
    }

    /** The U-shaped split's cluster relay and head correction (splitface/protocol/vectors/clusters, SPEC.md sections 8.1, 8.2). */
    @Test
    public void clusterVectors() throws Exception {
        int[] counts = conform(VECTORS.resolve("clusters"));
        assertTrue(counts[0] >= 6 && counts[1] >= 4);
    }

    /** The optional spent_epsilon fields and epsilon_regressed (splitface/protocol/vectors/epsilon, SPEC.md section 5.11). */
    @Test
    public void spentEpsilonVectors() throws Exception {
        int[] counts = conform(VECTORS.resolve("epsilon"));
        assertTrue(counts[0] >= 5 && counts[1] >= 7 && counts[2] >= 1);
        // and this core's own builder writes the reference's bytes
        byte[] vector = Files.readAllBytes(VECTORS.resolve("epsilon/01_forward_spent_epsilon.msgpack"));
        Map<String, Object> forward = Messages.decode(vector, Messages.DEFAULT_MAX_MESSAGE_BYTES);
        Tensor activations = (Tensor) forward.get("activations");
        byte[] built = ClientSessionTest.session().forward(1, activations.values(), new int[] {2, 2, 3}, new int[] {3, 7},
                false, (Double) forward.get("spent_epsilon"));
        assertArrayEquals(vector, built);
    }

    /** A patch-masked release's packed FORWARD (splitface/protocol/vectors/packed, SPEC.md section 5.12): decoded, its positions
     *  checked against its patches, and re-encoded as the reference does; malformed ones refused with its codes. */
    @Test
    public void packedVectors() throws Exception {
        int[] counts = conform(VECTORS.resolve("packed"));
        assertTrue(counts[0] >= 5 && counts[1] >= 11);
        Map<String, Object> forward = Messages.decode(Files.readAllBytes(VECTORS.resolve("packed/01_forward_packed_f32_labels.msgpack")),
                Messages.DEFAULT_MAX_MESSAGE_BYTES);
        assertArrayEquals(new long[] {2, 1, 6, 6}, Patches.check((Tensor) forward.get("activations"), (Map<?, ?>) forward.get("visible")));
    }

    /** i8c, int8 with a scale per image and channel (splitface/protocol/vectors/channel_scaled, SPEC.md sections 4, 5.10): decoded,
     *  malformed ones refused, and this core's encoder writes the reference's bytes for the FORWARD. */
    @Test
    public void channelScaledVectors() throws Exception {
        int[] counts = conform(VECTORS.resolve("channel_scaled"));
        assertTrue(counts[0] >= 4 && counts[1] >= 10);
        Map<String, Object> forward = Messages.decode(Files.readAllBytes(VECTORS.resolve("channel_scaled/01_forward_i8c_labels.msgpack")),
                Messages.DEFAULT_MAX_MESSAGE_BYTES);
        Tensor sent = (Tensor) forward.get("activations");
        float[] original = {0.5f, -1.25f, 3.0f, 0.1f, 0.0f, -2.0f, 1.0f, 2.5f, -0.75f, 100.0f, -0.001f, 7.0f};
        Tensor mine = Tensor.encode(original, sent.shape, "i8c");
        assertArrayEquals(sent.data, mine.data);
        assertArrayEquals(sent.scales, mine.scales);
        // a peak at float32's largest value: its 127 steps must decode finite (SPEC.md section 4)
        for (String encoding : new String[] {"i8", "i8c"}) {
            Tensor top = Tensor.encode(new float[] {Float.MAX_VALUE, -1e38f}, new int[] {1, 1, 2}, encoding);
            Tensor back = Tensor.fromWire(top.toWire(), "top");
            assertEquals(encoding, Float.MAX_VALUE, back.values()[0], Float.MAX_VALUE / 127 / 2);
        }
    }

    /** Checks every vector in `dir`; returns {valid, invalid, accepted} counts. */
    @SuppressWarnings("unchecked")
    static int[] conform(Path dir) throws Exception {
        List<Path> cases = cases(dir);
        assertTrue("no vectors found in " + dir.toAbsolutePath(), cases.size() >= 7);
        int valid = 0, invalid = 0, accepted = 0;
        for (Path json : cases) {
            String name = json.getFileName().toString().replace(".json", "");
            byte[] bytes = Files.readAllBytes(dir.resolve(name + ".msgpack"));
            Map<String, Object> expected = (Map<String, Object>) Json.parse(Files.readString(json, StandardCharsets.UTF_8));
            if (Boolean.TRUE.equals(expected.get("invalid"))) {
                try {
                    Messages.decode(bytes, Messages.DEFAULT_MAX_MESSAGE_BYTES);
                    fail(name + ": accepted an invalid message");
                } catch (ProtocolException e) {
                    assertEquals(name, expected.get("error_code"), e.code);
                }
                invalid++;
                continue;
            }
            if (Boolean.TRUE.equals(expected.get("accepted"))) {   // non-canonical bytes: the canonical case's meaning
                Map<String, Object> got = Messages.decode(bytes, Messages.DEFAULT_MAX_MESSAGE_BYTES);
                Map<String, Object> want = Messages.decode(Files.readAllBytes(dir.resolve(expected.get("canonical") + ".msgpack")),
                        Messages.DEFAULT_MAX_MESSAGE_BYTES);
                assertEquals(name, new ArrayList<>(want.keySet()), new ArrayList<>(got.keySet()));
                for (String key : want.keySet()) {
                    Object w = want.get(key), g = got.get(key);
                    if (w instanceof Tensor) assertArrayEquals(name + " " + key, ((Tensor) w).values(), ((Tensor) g).values(), 0f);
                    else if (w instanceof Number) assertEquals(name + " " + key, ((Number) w).doubleValue(), ((Number) g).doubleValue(), 0);
                    else assertEquals(name + " " + key, w, g);
                }
                accepted++;
                continue;
            }
            Map<String, Object> decoded = Messages.decode(bytes, Messages.DEFAULT_MAX_MESSAGE_BYTES);
            assertEquals(name + ": keys in wire order", new ArrayList<>(expected.keySet()), new ArrayList<>(decoded.keySet()));
            for (Map.Entry<String, Object> e : expected.entrySet()) {
                Object got = decoded.get(e.getKey());
                if (got instanceof Tensor) {
                    List<Object> values = (List<Object>) ((Map<String, Object>) e.getValue()).get("values");
                    float[] v = ((Tensor) got).values();
                    assertEquals(name, values.size(), v.length);
                    for (int i = 0; i < v.length; i++)
                        assertEquals(name + " value " + i, Float.floatToIntBits((float) ((Number) values.get(i)).doubleValue()),
                                Float.floatToIntBits(v[i]));
                }
            }
            assertArrayEquals(name + ": re-encoded", bytes, Messages.encode(decoded));
            assertArrayEquals(name + ": encoded from its JSON", bytes, Wire.pack(meaning(expected)));
            valid++;
        }
        return new int[] {valid, invalid, accepted};
    }
}
