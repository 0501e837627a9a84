package org.splitface.core;

import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * The packed form of a patch-masked release (splitface/protocol/SPEC.md section 5.12, splitface/protocol/patches.py): a FORWARD whose
 * {@code activations} are the {@code [T, C, P, P]} patches that travel and whose {@code visible} is
 * {@code {grid: [GH, GW], bits: bin}}, one bit per grid patch per image, least significant bit first. This core
 * never sends one; it validates them as the reference does, so that it conforms to protocol/vectors/packed.
 */
public final class Patches {
    private Patches() {}

    /** {@code visible}'s structure (BAD_MESSAGE when wrong): exactly {grid: two ints in 1..2^31-1, bits: bin}. */
    static boolean isVisibleField(Object v) {
        if (!(v instanceof Map) || !((Map<?, ?>) v).keySet().equals(Set.of("grid", "bits"))) return false;
        Object grid = ((Map<?, ?>) v).get("grid"), bits = ((Map<?, ?>) v).get("bits");
        if (!(grid instanceof List) || ((List<?>) grid).size() != 2 || !(bits instanceof byte[])) return false;
        for (Object d : (List<?>) grid)
            if (!(d instanceof Long) || (Long) d < 1 || (Long) d > Integer.MAX_VALUE) return false;
        return true;
    }

    /** The dense shape {@code [N, C, GH*P, GW*P]} a valid packed release stands for; BAD_TENSOR when the patches and
     *  the bitmask disagree (rank, square patches, bitmask length, positions past the grid, count) or the dense
     *  tensor would break SPEC.md section 4's bounds. */
    static long[] check(Tensor patches, Map<?, ?> visible) {
        int[] s = patches.shape;
        if (s.length != 4 || s[2] != s[3] || s[2] < 1)
            throw bad("patches must be [T, C, P, P] with P >= 1, got " + java.util.Arrays.toString(s));
        List<?> grid = (List<?>) visible.get("grid");
        long gh = (Long) grid.get(0), gw = (Long) grid.get(1), cells = gh * gw;   // < 2^62: no overflow
        long perImage = (cells + 7) / 8;
        byte[] bits = (byte[]) visible.get("bits");
        if (bits.length == 0 || bits.length % perImage != 0)
            throw bad("visible.bits has " + bits.length + " bytes: not a positive multiple of " + perImage);
        long n = bits.length / perImage;
        int spare = (int) (perImage * 8 - cells);
        long sent = 0;
        for (int i = 0; i < bits.length; i++) {
            int b = bits[i] & 0xff;
            if (spare > 0 && (i + 1) % perImage == 0 && (b >>> (8 - spare)) != 0)
                throw bad("visible.bits sets a position past the " + gh + " x " + gw + " grid");
            sent += Integer.bitCount(b);
        }
        if (sent != s[0]) throw bad("visible.bits marks " + sent + " patches but activations carries " + s[0]);
        long[] shape = {n, s[1], gh * s[2], gw * s[2]};
        double nonZero = 1;   // as a double: the product of four dimensions may pass 2^63
        for (long d : shape) {
            if (d > Integer.MAX_VALUE) throw bad("unpacks to a dimension of " + d + ", beyond " + Integer.MAX_VALUE);
            if (d > 0) nonZero *= d;
        }
        if (nonZero > Integer.MAX_VALUE) throw bad("unpacks beyond the tensor bounds");
        return shape;
    }

    private static ProtocolException bad(String why) {
        return new ProtocolException(ProtocolException.BAD_TENSOR, "activations (packed): " + why);
    }
}
