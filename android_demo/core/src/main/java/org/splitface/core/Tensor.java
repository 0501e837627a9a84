package org.splitface.core;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/** The wire tensor {dtype, shape, data[, scale | scales]} of splitface/protocol/SPEC.md, as splitface/protocol/tensor.py encodes it. */
public final class Tensor {
    public static final int MAX_RANK = 8;
    public static final int I8C_MIN_RANK = 3;   // SPEC.md 5.10: fewer axes asked for as i8c go as i8
    public final String dtype;
    public final int[] shape;
    public final byte[] data;      // little-endian wire bytes
    public final Double scale;     // f16 and i8 only
    public final byte[] scales;    // i8c only: shape[0] x shape[1] little-endian float32

    private Tensor(String dtype, int[] shape, byte[] data, Double scale, byte[] scales) {
        this.dtype = dtype; this.shape = shape; this.data = data; this.scale = scale; this.scales = scales;
    }

    private Tensor(String dtype, int[] shape, byte[] data, Double scale) { this(dtype, shape, data, scale, null); }

    public static int numel(int[] shape) {
        int n = 1;
        for (int d : shape) n *= d;
        return n;
    }

    /** Encode float values in "f32", "f16" (power-of-two scale), "i8" (scale = max/127) or "i8c" (max/127 per image
     *  and channel). */
    public static Tensor encode(float[] values, int[] shape, String encoding) {
        if (values.length != numel(shape)) throw new IllegalArgumentException("values do not match the shape");
        if ("i8c".equals(encoding) && shape.length < I8C_MIN_RANK) encoding = "i8";
        switch (encoding) {
            case "f32": {
                ByteBuffer b = ByteBuffer.allocate(values.length * 4).order(ByteOrder.LITTLE_ENDIAN);
                for (float v : values) b.putFloat(v);
                return new Tensor("f32", shape.clone(), b.array(), null);
            }
            case "f16": {
                double peak = peak(values);
                int exponent = peak > 0 ? frexpExponent(peak) : 0;
                double scale = peak > 0 ? Math.scalb(1.0, Math.max(exponent - 15, -126)) : 1.0;
                float fscale = (float) scale;
                // SPEC.md 4: a peak within a factor 2 of float32's largest value is clamped so it cannot round up to infinity
                float top = exponent == 128 ? 32752f : Float.POSITIVE_INFINITY;
                ByteBuffer b = ByteBuffer.allocate(values.length * 2).order(ByteOrder.LITTLE_ENDIAN);
                for (float v : values) b.putShort(Half.fromFloat(Math.max(-top, Math.min(top, v / fscale))));
                return new Tensor("f16", shape.clone(), b.array(), scale);
            }
            case "i8": {
                double peak = peak(values);
                double scale = peak > 0 && (float) (peak / 127.0) > 0 ? peak / 127.0 : 1.0;  // a subnormal peak: zeros
                if (Float.isInfinite(127f * (float) scale)) scale = Math.nextDown((float) scale);  // SPEC.md 4
                float fscale = (float) scale;
                byte[] q = new byte[values.length];
                for (int i = 0; i < values.length; i++) {
                    double r = Math.rint(values[i] / fscale);
                    q[i] = (byte) Math.max(-127, Math.min(127, r));
                }
                return new Tensor("i8", shape.clone(), q, scale);
            }
            case "i8c": {
                int groups = shape[0] * shape[1], size = groups == 0 ? 0 : values.length / groups;
                byte[] q = new byte[values.length];
                ByteBuffer scales = ByteBuffer.allocate(groups * 4).order(ByteOrder.LITTLE_ENDIAN);
                for (int g = 0; g < groups; g++) {
                    float peak = 0;
                    for (int i = g * size; i < (g + 1) * size; i++) peak = Math.max(peak, Math.abs(values[i]));
                    float fscale = Float.isFinite(peak) && (float) (peak / 127.0) > 0 ? (float) (peak / 127.0) : 1f;
                    if (Float.isInfinite(127f * fscale)) fscale = Math.nextDown(fscale);       // SPEC.md 4
                    scales.putFloat(fscale);
                    for (int i = g * size; i < (g + 1) * size; i++)
                        q[i] = (byte) Math.max(-127, Math.min(127, Math.rint(values[i] / fscale)));
                }
                return new Tensor("i8c", shape.clone(), q, null, scales.array());
            }
            default: throw new IllegalArgumentException("unknown encoding " + encoding);
        }
    }

    private static double peak(float[] values) {
        float peak = 0;
        for (float v : values) peak = Math.max(peak, Math.abs(v));
        return Float.isFinite(peak) ? peak : 0.0;
    }

    /** Python's math.frexp exponent: x = m * 2^e with m in [0.5, 1). */
    private static int frexpExponent(double x) { return Math.getExponent(x) + 1; }

    /** Validate a decoded wire map (BAD_TENSOR on any mismatch), as splitface/protocol/tensor.py decode_tensor. */
    public static Tensor fromWire(Object obj, String field) {
        if (!(obj instanceof Map)) throw bad(field + ": expected a map");
        Map<?, ?> m = (Map<?, ?>) obj;
        Object dtype = m.get("dtype"), shape = m.get("shape"), data = m.get("data");
        if (!List.of("f32", "f16", "i8", "i8c").contains(dtype))
            throw bad(field + ": dtype " + dtype + " is not one of [f32, f16, i8, i8c]");
        if (!(shape instanceof List) || ((List<?>) shape).size() > MAX_RANK) throw bad(field + ": shape must be a list of at most 8 non-negative ints");
        List<?> dims = (List<?>) shape;
        int[] s = new int[dims.size()];
        for (int i = 0; i < s.length; i++) {
            Object d = dims.get(i);
            if (!(d instanceof Long) || (Long) d < 0 || (Long) d > Integer.MAX_VALUE) throw bad(field + ": shape must be a list of at most 8 non-negative ints");
            s[i] = (int) (long) (Long) d;
        }
        long nonZero = 1;                 // SPEC.md section 4: the non-zero dimensions fit a 32-bit index
        for (int d : s) if (d > 0 && (nonZero *= d) > Integer.MAX_VALUE)
            throw bad(field + ": shape is too large: its non-zero dimensions multiply to more than " + Integer.MAX_VALUE);
        if (!(data instanceof byte[])) throw bad(field + ": data must be bin");
        for (Object k : m.keySet())
            if (!List.of("dtype", "shape", "data", "scale", "scales").contains(k)) throw bad(field + ": unexpected key " + k);
        int item = "f32".equals(dtype) ? 4 : "f16".equals(dtype) ? 2 : 1;
        long expected = 1;
        for (int d : s) expected *= d;
        expected *= item;
        byte[] bytes = (byte[]) data;
        if (bytes.length != expected) throw bad(field + ": " + bytes.length + " bytes do not match dtype x shape (" + expected + " bytes)");
        Double scale = null;
        byte[] scales = null;
        if (m.containsKey("scales") && !"i8c".equals(dtype)) throw bad(field + ": " + dtype + " takes no scales (only i8c does)");
        if ("i8c".equals(dtype)) {
            if (m.containsKey("scale")) throw bad(field + ": i8c takes scales, not a scale");
            if (s.length < I8C_MIN_RANK) throw bad(field + ": i8c needs at least " + I8C_MIN_RANK + " axes");
            Object sc = m.get("scales");
            if (!(sc instanceof byte[]) || ((byte[]) sc).length != (long) s[0] * s[1] * 4)
                throw bad(field + ": i8c needs scales: bin of one float32 per image and channel");
            scales = (byte[]) sc;
            ByteBuffer b = ByteBuffer.wrap(scales).order(ByteOrder.LITTLE_ENDIAN);
            for (int i = 0; i < scales.length / 4; i++) {
                float v = b.getFloat();
                if (!(Float.isFinite(v) && v > 0)) throw bad(field + ": i8c scales must be finite and > 0");
            }
        } else if (!"f32".equals(dtype)) {
            Object sc = m.get("scale");
            // a number: float64, or an int (a JavaScript encoder writes whole numbers as ints; SPEC.md section 3)
            double v = sc instanceof Double || Messages.isInt(sc) ? ((Number) sc).doubleValue() : Double.NaN;
            if (!(Double.isFinite(v) && v > 0)) throw bad(field + ": " + dtype + " needs a finite positive scale");
            scale = v;
        } else if (m.containsKey("scale")) throw bad(field + ": f32 takes no scale");
        Tensor t = new Tensor((String) dtype, s, bytes, scale, scales);
        for (float v : t.values()) if (!Float.isFinite(v)) throw bad(field + ": contains NaN or infinity");
        return t;
    }

    /** The float32 values the receiver uses (scale applied as a float32, as the reference does). */
    public float[] values() {
        int n = numel(shape);
        float[] out = new float[n];
        ByteBuffer b = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
        float fscale = scale == null ? 1f : (float) (double) scale;
        ByteBuffer groupScales = scales == null ? null : ByteBuffer.wrap(scales).order(ByteOrder.LITTLE_ENDIAN);
        int groups = scales == null ? 0 : scales.length / 4, size = groups == 0 ? 0 : n / groups;
        for (int i = 0; i < n; i++) {
            switch (dtype) {
                case "f32": out[i] = b.getFloat(); break;
                case "f16": out[i] = Half.toFloat(b.getShort()) * fscale; break;
                case "i8c": out[i] = data[i] * groupScales.getFloat(i / size * 4); break;
                default: out[i] = data[i] * fscale;
            }
        }
        return out;
    }

    public Map<String, Object> toWire() {
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("dtype", dtype);
        List<Object> dims = new ArrayList<>();
        for (int d : shape) dims.add((long) d);
        m.put("shape", dims);
        m.put("data", data);
        if (scale != null) m.put("scale", scale);
        if (scales != null) m.put("scales", scales);
        return m;
    }

    private static ProtocolException bad(String message) {
        return new ProtocolException(ProtocolException.BAD_TENSOR, message);
    }
}
