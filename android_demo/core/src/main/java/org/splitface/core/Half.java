package org.splitface.core;

/** IEEE 754 binary16 conversions (Java 17 has no Float.floatToFloat16), round to nearest even. */
final class Half {
    private Half() {}

    static float toFloat(short h) {
        int bits = h & 0xffff, sign = (bits & 0x8000) << 16, exp = (bits >>> 10) & 0x1f, mant = bits & 0x3ff;
        if (exp == 0x1f) return Float.intBitsToFloat(sign | 0x7f800000 | (mant << 13));
        if (exp == 0) {
            float v = mant * 0x1p-24f;   // subnormal
            return sign != 0 ? -v : v;
        }
        return Float.intBitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
    }

    static short fromFloat(float f) {
        int bits = Float.floatToRawIntBits(f), sign = (bits >>> 16) & 0x8000;
        int exp = (bits >>> 23) & 0xff, mant = bits & 0x7fffff;
        if (exp == 0xff) return (short) (sign | 0x7c00 | (mant != 0 ? 0x200 : 0));
        int e = exp - 127 + 15;
        if (e >= 0x1f) return (short) (sign | 0x7c00);                  // overflow to infinity
        if (e <= 0) {                                                     // subnormal or zero
            if (e < -10) return (short) sign;
            mant |= 0x800000;
            int shift = 14 - e;
            int half = mant >>> shift, rest = mant & ((1 << shift) - 1), mid = 1 << (shift - 1);
            if (rest > mid || (rest == mid && (half & 1) != 0)) half++;
            return (short) (sign | half);
        }
        int half = (e << 10) | (mant >>> 13), rest = mant & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (half & 1) != 0)) half++;  // may carry into the exponent: correct
        return (short) (sign | half);
    }
}
