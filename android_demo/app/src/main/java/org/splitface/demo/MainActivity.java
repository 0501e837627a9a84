package org.splitface.demo;

import android.app.Activity;
import android.os.Bundle;
import android.widget.Button;
import android.widget.EditText;
import android.widget.TextView;
import java.io.File;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import org.json.JSONArray;
import org.json.JSONObject;
import org.splitface.core.BatchMetrics;
import org.splitface.core.BudgetGuard;
import org.splitface.core.ClientSession;
import org.splitface.core.DeviceClient;
import org.splitface.core.Messages;
import org.splitface.core.PerActivationNoise;
import org.splitface.core.RemoteError;
import org.splitface.core.Tls;
import org.splitface.core.UntrustedServer;

/**
 * Start/stop a training session against an edge server; per batch, show latency, bytes, energy and
 * privacy budget. Inputs live in the app's external files directory (see android_demo/README.md):
 * programs/ (splitface-export output), faces/<identity>/*.jpg, device.json, schedule.msgpack.
 */
public class MainActivity extends Activity {
    private volatile boolean running;
    private Thread worker;
    private TextView status, batches;

    @Override protected void onCreate(Bundle state) {
        super.onCreate(state);
        setContentView(R.layout.activity_main);
        status = findViewById(R.id.status);
        batches = findViewById(R.id.batches);
        Button button = findViewById(R.id.start_stop);
        button.setOnClickListener(v -> {
            if (running) { running = false; button.setText("Start"); return; }
            running = true;
            button.setText("Stop");
            String url = ((EditText) findViewById(R.id.url)).getText().toString();
            String id = ((EditText) findViewById(R.id.device_id)).getText().toString();
            String token = ((EditText) findViewById(R.id.token)).getText().toString();
            worker = new Thread(() -> train(url, id, token), "splitface-training");
            worker.start();
        });
    }

    private void show(TextView view, String text, boolean append) {
        runOnUiThread(() -> { if (append) view.append(text + "\n"); else view.setText(text); });
    }

    private void train(String url, String deviceId, String token) {
        File root = getExternalFilesDir(null);
        BatteryMeter meter = new BatteryMeter(this);
        try {
            JSONObject cfg = new JSONObject(new String(Files.readAllBytes(new File(root, "device.json").toPath()), StandardCharsets.UTF_8));
            JSONObject manifest = new JSONObject(new String(Files.readAllBytes(new File(root, "programs/manifest.json").toPath()), StandardCharsets.UTF_8));
            int batch = manifest.getInt("batch_size");
            JSONArray act = manifest.getJSONArray("activation_shape"), names = manifest.getJSONArray("weight_names");
            int channels = act.getInt(1), size = act.getInt(2);
            String[] weightNames = new String[names.length()];
            for (int i = 0; i < weightNames.length; i++) weightNames[i] = names.getString(i);
            List<String> classes = new ArrayList<>();
            JSONArray cls = cfg.getJSONArray("classes");
            for (int i = 0; i < cls.length(); i++) classes.add(cls.getString(i));
            FaceFolder faces = new FaceFolder(new File(root, "faces"), classes);
            ExecuTorchLayerTrainer layer = new ExecuTorchLayerTrainer(new File(root, "programs/release.pte").getPath(),
                    new File(root, "programs/train.pte").getPath(), weightNames, batch, channels, size,
                    cfg.getDouble("lr"), cfg.optDouble("momentum", 0.9), cfg.optDouble("weight_decay", 0));
            PerActivationNoise noise = cfg.isNull("epsilon") ? null : new PerActivationNoise(cfg.getDouble("epsilon"), cfg.getDouble("delta"));
            File schedule = new File(root, "schedule.msgpack");
            BudgetGuard guard = schedule.exists() ? BudgetGuard.fromSchedule(Files.readAllBytes(schedule.toPath()), cfg.getDouble("budget")) : null;
            // durable, in the app's private files dir: a restarted app resumes its spent epsilon, never 0
            if (guard != null) guard.persistIn(BudgetGuard.stateFile(getFilesDir().toPath(), deviceId), deviceId);
            Map<String, String> enc = new LinkedHashMap<>();
            enc.put("activations", "f32");
            enc.put("gradients", "f32");
            ClientSession session = new ClientSession(deviceId, token, toMap(cfg.getJSONObject("model")), cfg.optString("split", "conv1"),
                    "server", batch, cfg.getInt("num_classes"), enc);
            File ca = new File(root, "ca.pem");   // the CA that signed the server's certificate (wss://)
            Tls tls = Tls.forUrl(url, ca.exists() ? ca.toPath() : null, cfg.optBoolean("insecure", false));
            try (DeviceClient client = new DeviceClient(url, OkHttpTransport.factory(tls), session, layer, noise, guard,
                    120_000, 10, Messages.DEFAULT_MAX_MESSAGE_BYTES)) {
                client.connect();
                int perEpoch = faces.images.size() / batch;   // the programs take exactly `batch` images: the remainder waits
                while (running) {
                    long id = client.committed() + 1;
                    int start = (int) ((id - 1) % perEpoch) * batch;
                    float[] x = new float[batch * 3 * size * size];
                    int[] y = new int[batch];
                    long[] ids = new long[batch];
                    for (int j = 0; j < batch; j++) {
                        System.arraycopy(faces.load(start + j, size), 0, x, j * 3 * size * size, 3 * size * size);
                        y[j] = faces.labels.get(start + j);
                        ids[j] = start + j;
                    }
                    meter.start();
                    BatchMetrics m = client.trainBatch(id, x, new int[] {batch, 3, size, size}, y, ids);
                    Double mah = meter.stopMilliAmpHours();
                    Double counter = meter.counterMilliAmpHours();
                    show(batches, describe(m, mah, counter), true);
                    show(status, meter.charging() ? "CHARGING: energy readings are the charger's, not the battery's"
                            : "training, batch " + id, false);
                }
            }
            show(status, "stopped", false);
        } catch (RemoteError e) {
            show(status, "The server refused: " + e.detail + " (" + e.code + ")", false);
        } catch (UntrustedServer e) {
            show(status, "Not connecting: " + e.getMessage(), false);
        } catch (BudgetGuard.BudgetExceeded e) {
            show(status, "Privacy budget spent; nothing more was sent. " + e.getMessage(), false);
        } catch (BudgetGuard.LostState | BudgetGuard.StateFileError e) {
            show(status, "Privacy state cannot be trusted; nothing was sent. " + e.getMessage(), false);
        } catch (Exception e) {
            show(status, "Stopped: " + e.getMessage(), false);
        } finally {
            running = false;
        }
    }

    /** One line per batch; counter = the CHARGE_COUNTER delta (coarse, often whole mAh steps: read it over many batches). */
    private static String describe(BatchMetrics m, Double mah, Double counter) {
        double seconds = (m.forwardMs() + m.roundTripMs() + m.backwardMs()) / 1000;
        String energy = (mah == null ? "current n/a" : String.format(Locale.ROOT, "%.4f mAh (%.2f mAh/min)", mah, mah / seconds * 60))
                + (counter == null ? ", counter n/a" : String.format(Locale.ROOT, ", counter %.3f mAh", counter));
        return String.format(Locale.ROOT, "#%d fwd %.0f ms bwd %.0f ms rtt %.0f ms | up %.1f MB down %.1f MB | %s | eps %s left %s",
                m.batchId(), m.forwardMs(), m.backwardMs(), m.roundTripMs(), m.bytesUp() / 1e6, m.bytesDown() / 1e6, energy,
                fmt(m.epsilonSpent()), fmt(m.epsilonLeft()));
    }

    private static String fmt(double v) { return Double.isNaN(v) ? "-" : String.format(Locale.ROOT, "%.3g", v); }

    /** JSON model spec -> the map the HELLO carries (ints as long, reals as double, as the server sends them). */
    private static Map<String, Object> toMap(JSONObject o) throws Exception {
        Map<String, Object> m = new LinkedHashMap<>();
        for (Iterator<String> keys = o.keys(); keys.hasNext(); ) {
            String k = keys.next();
            Object v = o.get(k);
            if (v instanceof Integer || v instanceof Long) v = ((Number) v).longValue();
            else if (v instanceof Number) v = ((Number) v).doubleValue();
            else if (v == JSONObject.NULL) v = null;
            m.put(k, v);
        }
        return m;
    }
}
