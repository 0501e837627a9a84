package org.splitface.core;

/**
 * What runs the device layer and updates it: the plain-Java reference ({@link ReferenceLayerTrainer})
 * here, ExecuTorch's release and training programs in the Android app.
 */
public interface LayerTrainer {
    int[] outputShape(int n, int h, int w);

    /** The activations of a batch of NCHW images in [0, 1], before any noise. */
    float[] forward(float[] images, int n, int h, int w);

    /** Backward of the last forward given the server's gradient, then one optimiser step. */
    void step(float[] activationGrad);

    /**
     * The weight gradients {@link #step} would apply for the last forward, without applying them (parity checks
     * and benchmarks); a trainer whose training program applies them itself has none to give.
     */
    default float[][] weightGrads(float[] activationGrad) {
        throw new UnsupportedOperationException(getClass().getSimpleName() + " applies its gradients inside its program");
    }

    /** A copy of everything {@link #step} changes, for rolling back to a server checkpoint. */
    Object snapshot();

    void restore(Object snapshot);
}
