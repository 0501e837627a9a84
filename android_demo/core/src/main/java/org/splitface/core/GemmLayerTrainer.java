package org.splitface.core;

/**
 * The device layer on the im2col programs (`splitface-export --gemm`: release_gemm.pte and vjp_gemm.pte, XNNPACK
 * with the weights as inputs), the fast path a phone takes: the release is the layer's output for the current
 * weights, the weight gradient its closed-form vector-Jacobian product with the server's gradient, and SGD runs
 * here on the weights the layer holds. The programs are exported for one batch size; a shorter last batch is
 * padded with zero images (and a zero gradient, which adds nothing) and cut again.
 */
public final class GemmLayerTrainer extends SgdLayerTrainer {
    private final Program release, vjp;
    private final int batch;
    private float[] lastImages;        // padded to the programs' batch
    private int lastN;

    public GemmLayerTrainer(Program release, Program vjp, DeviceLayer layer, Sgd sgd) {
        super(layer, sgd);
        this.release = release; this.vjp = vjp;
        this.batch = (int) release.inputShape(0)[0];
        if (layer.bias == null) throw new IllegalArgumentException("the im2col programs take a conv with a bias");
    }

    @Override public float[] forward(float[] images, int n, int h, int w) {
        long[] shape = release.inputShape(0);
        if (n > batch || h != shape[2] || w != shape[3] || images.length != n * shape[1] * h * w)
            throw new IllegalArgumentException(images.length + " values as " + n + " images of " + h + " x " + w
                    + "; the programs take up to " + batch + " images of " + shape[1] + " x " + shape[2] + " x " + shape[3]);
        lastImages = padded(images, (int) numel(shape));
        lastN = n;
        float[] noise = new float[(int) numel(release.inputShape(1))];   // noise is added by the DeviceClient
        float[] out = release.forward(new float[][] {lastImages, noise, layer.weight, layer.bias})[0];
        return java.util.Arrays.copyOf(out, out.length / batch * n);
    }

    /** The weight and bias gradients of the last forward's images given the server's gradient. */
    @Override public float[][] weightGrads(float[] activationGrad) {
        if (lastImages == null) throw new IllegalStateException("weightGrads before any forward");
        long perImage = numel(vjp.inputShape(1)) / batch;
        if (activationGrad.length != lastN * perImage)
            throw new IllegalArgumentException("a gradient of " + activationGrad.length + " values; the last forward's "
                    + lastN + " images take " + lastN * perImage);
        float[] grad = padded(activationGrad, (int) numel(vjp.inputShape(1)));
        float[][] g = vjp.forward(new float[][] {lastImages, grad, layer.weight, layer.bias});
        return new float[][] {g[0], g[1]};
    }

    private static float[] padded(float[] values, int size) {
        if (values.length > size) throw new IllegalArgumentException(values.length + " values; the programs take " + size);
        return values.length == size ? values : java.util.Arrays.copyOf(values, size);
    }

    private static long numel(long[] shape) {
        long n = 1;
        for (long d : shape) n *= d;
        return n;
    }
}
