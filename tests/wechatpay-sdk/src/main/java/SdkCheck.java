// The official wechatpay-java SDK against our side of WeChat Pay API v3:
//
//   verify-requests <merchant.pub.pem> <requests.json>
//       every request our adapter signed (as the simulator logged it:
//       method, path, Authorization, body) verifies with the SDK's
//       RSAVerifier over the message the SDK's own credential signs.
//   client <sim url> <mchid> <merchant serial> <merchant.pem>
//          <platform serial> <platform.pub.pem> <apiv3 key> <out_trade_no>
//       the SDK's own client prepays, queries, has the simulator pay,
//       queries, refunds, queries the refund, and closes a second trade,
//       against the simulator: the simulator takes the SDK's signatures and
//       the SDK takes the simulator's answers.
//   listen <platform serial> <platform.pub.pem> <apiv3 key>
//       a callback receiver: each callback the simulator sends is parsed
//       by the SDK's NotificationParser (204, one JSON line on stdout) or
//       refused (401).
//   jsapi <sim url> <mchid> <merchant serial> <merchant.pem>
//         <platform serial> <platform.pub.pem> <apiv3 key> <out_trade_no>
//         <appid> <openid>
//       the SDK's JsapiServiceExtension prepays a JSAPI trade against the
//       simulator and builds wx.requestPayment's parameters (its own
//       timeStamp and nonceStr, its paySign with the merchant key); prints
//       them as one JSON line, for our adapter to sign the same.
//   sign-callback <notify url> <serial> <platform.pem> <apiv3 key>
//          <out_trade_no> <amount>
//       a TRANSACTION.SUCCESS callback sealed with the SDK's AeadAesCipher
//       and signed with the SDK's RSASigner, sent to our server; prints
//       its answer's status.
//
// Exit status 0 only when every check held.

import com.google.gson.Gson;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.sun.net.httpserver.HttpServer;
import com.wechat.pay.java.core.RSAPublicKeyConfig;
import com.wechat.pay.java.core.cipher.AeadAesCipher;
import com.wechat.pay.java.core.cipher.RSASigner;
import com.wechat.pay.java.core.cipher.RSAVerifier;
import com.wechat.pay.java.core.http.DefaultHttpClientBuilder;
import com.wechat.pay.java.core.http.HttpClient;
import com.wechat.pay.java.core.notification.NotificationParser;
import com.wechat.pay.java.core.notification.RequestParam;
import com.wechat.pay.java.core.util.PemUtil;
import com.wechat.pay.java.service.payments.jsapi.JsapiServiceExtension;
import com.wechat.pay.java.service.payments.jsapi.model.Payer;
import com.wechat.pay.java.service.payments.jsapi.model.PrepayWithRequestPaymentResponse;
import com.wechat.pay.java.service.payments.model.Transaction;
import com.wechat.pay.java.service.payments.nativepay.NativePayService;
import com.wechat.pay.java.service.payments.nativepay.model.Amount;
import com.wechat.pay.java.service.payments.nativepay.model.CloseOrderRequest;
import com.wechat.pay.java.service.payments.nativepay.model.PrepayRequest;
import com.wechat.pay.java.service.payments.nativepay.model.PrepayResponse;
import com.wechat.pay.java.service.payments.nativepay.model.QueryOrderByOutTradeNoRequest;
import com.wechat.pay.java.service.refund.RefundService;
import com.wechat.pay.java.service.refund.model.AmountReq;
import com.wechat.pay.java.service.refund.model.CreateRequest;
import com.wechat.pay.java.service.refund.model.QueryByOutRefundNoRequest;
import com.wechat.pay.java.service.refund.model.Refund;
import java.io.InputStream;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.PrivateKey;
import java.time.Instant;
import java.util.HashMap;
import java.util.Map;
import java.util.UUID;

public final class SdkCheck {
  private static final Gson GSON = new Gson();

  public static void main(String[] args) throws Exception {
    switch (args[0]) {
      case "verify-requests" -> verifyRequests(args);
      case "client" -> client(args);
      case "jsapi" -> jsapi(args);
      case "listen" -> listen(args);
      case "sign-callback" -> signCallback(args);
      default -> throw new IllegalArgumentException("unknown mode " + args[0]);
    }
  }

  private static void fail(String why) {
    System.err.println("SDK CHECK FAILED: " + why);
    System.exit(1);
  }

  private static Map<String, String> authorization(String header) {
    Map<String, String> fields = new HashMap<>();
    String params = header.substring("WECHATPAY2-SHA256-RSA2048 ".length());
    for (String part : params.split(",")) {
      int eq = part.indexOf('=');
      fields.put(part.substring(0, eq).trim(), part.substring(eq + 1).trim().replace("\"", ""));
    }
    return fields;
  }

  /** What WechatPay2Credential signs (its buildMessage): five lines. */
  private static String requestMessage(String method, String path, String ts, String nonce, String body) {
    return method + "\n" + path + "\n" + ts + "\n" + nonce + "\n" + body + "\n";
  }

  private static void verifyRequests(String[] args) throws Exception {
    var publicKey = PemUtil.loadPublicKeyFromPath(args[1]);
    JsonArray requests = GSON.fromJson(Files.readString(Path.of(args[2])), JsonArray.class);
    int verified = 0;
    for (JsonElement e : requests) {
      JsonObject r = e.getAsJsonObject();
      Map<String, String> auth = authorization(r.get("authorization").getAsString());
      String serial = auth.get("serial_no");
      RSAVerifier verifier = new RSAVerifier(publicKey, serial);
      String message =
          requestMessage(
              r.get("method").getAsString(),
              r.get("path").getAsString(),
              auth.get("timestamp"),
              auth.get("nonce_str"),
              r.get("body").getAsString());
      if (!verifier.verify(serial, message, auth.get("signature"))) {
        fail("our signature of " + r.get("method") + " " + r.get("path") + " does not verify");
      }
      verified++;
    }
    if (verified == 0) {
      fail("no request to verify");
    }
    System.out.println("{\"verified\":" + verified + "}");
  }

  private static HttpClient sdkClient(String[] args, RSAPublicKeyConfig config) {
    URI sim = URI.create(args[1]);
    // The SDK always calls api.mch.weixin.qq.com over HTTPS: send it to
    // the simulator instead. What is signed (the path) does not change.
    okhttp3.OkHttpClient okHttp =
        new okhttp3.OkHttpClient.Builder()
            .addInterceptor(
                chain -> {
                  okhttp3.Request req = chain.request();
                  okhttp3.HttpUrl url =
                      req.url().newBuilder().scheme("http").host(sim.getHost()).port(sim.getPort()).build();
                  return chain.proceed(req.newBuilder().url(url).build());
                })
            .build();
    return new DefaultHttpClientBuilder().config(config).okHttpClient(okHttp).build();
  }

  private static void client(String[] args) throws Exception {
    String mchid = args[2];
    RSAPublicKeyConfig config =
        new RSAPublicKeyConfig.Builder()
            .merchantId(mchid)
            .privateKeyFromPath(args[4])
            .merchantSerialNumber(args[3])
            .publicKeyFromPath(args[6])
            .publicKeyId(args[5])
            .apiV3Key(args[7])
            .build();
    HttpClient http = sdkClient(args, config);
    NativePayService pay = new NativePayService.Builder().httpClient(http).build();
    RefundService refunds = new RefundService.Builder().httpClient(http).build();
    String tradeNo = args[8];

    PrepayRequest prepay = new PrepayRequest();
    Amount amount = new Amount();
    amount.setTotal(100);
    prepay.setAmount(amount);
    prepay.setAppid("wxd678efh567hg6787");
    prepay.setMchid(mchid);
    prepay.setDescription("SDK check");
    prepay.setNotifyUrl("https://shop.example/notify");
    prepay.setOutTradeNo(tradeNo);
    PrepayResponse prepaid = pay.prepay(prepay);
    if (prepaid.getCodeUrl() == null || !prepaid.getCodeUrl().startsWith("weixin://")) {
      fail("prepay answered " + prepaid);
    }

    QueryOrderByOutTradeNoRequest query = new QueryOrderByOutTradeNoRequest();
    query.setMchid(mchid);
    query.setOutTradeNo(tradeNo);
    Transaction before = pay.queryOrderByOutTradeNo(query);
    if (before.getTradeState() != Transaction.TradeStateEnum.NOTPAY) {
      fail("a new trade is " + before.getTradeState());
    }
    var plain = java.net.http.HttpClient.newHttpClient();
    var paid =
        plain.send(
            HttpRequest.newBuilder(URI.create(args[1] + "/sim/pay/" + tradeNo))
                .header("content-type", "application/json")
                .POST(HttpRequest.BodyPublishers.ofString("{\"deliver\":false}"))
                .build(),
            HttpResponse.BodyHandlers.ofString());
    if (paid.statusCode() != 200) {
      fail("the simulator did not pay: " + paid.statusCode());
    }
    Transaction after = pay.queryOrderByOutTradeNo(query);
    if (after.getTradeState() != Transaction.TradeStateEnum.SUCCESS
        || after.getAmount().getTotal() != 100
        || after.getTransactionId() == null) {
      fail("a paid trade reads " + GSON.toJson(after));
    }

    CreateRequest create = new CreateRequest();
    create.setOutTradeNo(tradeNo);
    create.setOutRefundNo("R" + tradeNo);
    create.setReason("SDK check");
    AmountReq refundAmount = new AmountReq();
    refundAmount.setRefund(100L);
    refundAmount.setTotal(100L);
    refundAmount.setCurrency("CNY");
    create.setAmount(refundAmount);
    Refund refund = refunds.create(create);
    if (refund.getRefundId() == null || !("R" + tradeNo).equals(refund.getOutRefundNo())) {
      fail("a refund answered " + GSON.toJson(refund));
    }
    QueryByOutRefundNoRequest refundQuery = new QueryByOutRefundNoRequest();
    refundQuery.setOutRefundNo("R" + tradeNo);
    Refund found = refunds.queryByOutRefundNo(refundQuery);
    if (!refund.getRefundId().equals(found.getRefundId())) {
      fail("the refund queried is another: " + GSON.toJson(found));
    }

    PrepayRequest second = GSON.fromJson(GSON.toJson(prepay), PrepayRequest.class);
    second.setOutTradeNo(tradeNo + "9");
    pay.prepay(second);
    CloseOrderRequest close = new CloseOrderRequest();
    close.setMchid(mchid);
    close.setOutTradeNo(tradeNo + "9");
    pay.closeOrder(close);
    QueryOrderByOutTradeNoRequest closedQuery = new QueryOrderByOutTradeNoRequest();
    closedQuery.setMchid(mchid);
    closedQuery.setOutTradeNo(tradeNo + "9");
    if (pay.queryOrderByOutTradeNo(closedQuery).getTradeState() != Transaction.TradeStateEnum.CLOSED) {
      fail("a closed trade is not CLOSED");
    }
    System.out.println(
        "{\"prepaid\":true,\"paid\":\"" + after.getTransactionId() + "\",\"refund\":\"" + found.getStatus() + "\",\"closed\":true}");
  }

  private static void jsapi(String[] args) throws Exception {
    RSAPublicKeyConfig config =
        new RSAPublicKeyConfig.Builder()
            .merchantId(args[2])
            .privateKeyFromPath(args[4])
            .merchantSerialNumber(args[3])
            .publicKeyFromPath(args[6])
            .publicKeyId(args[5])
            .apiV3Key(args[7])
            .build();
    JsapiServiceExtension service =
        new JsapiServiceExtension.Builder().config(config).httpClient(sdkClient(args, config)).build();
    com.wechat.pay.java.service.payments.jsapi.model.PrepayRequest prepay =
        new com.wechat.pay.java.service.payments.jsapi.model.PrepayRequest();
    com.wechat.pay.java.service.payments.jsapi.model.Amount amount =
        new com.wechat.pay.java.service.payments.jsapi.model.Amount();
    amount.setTotal(100);
    prepay.setAmount(amount);
    prepay.setAppid(args[9]);
    prepay.setMchid(args[2]);
    prepay.setDescription("SDK check");
    prepay.setNotifyUrl("https://shop.example/notify");
    prepay.setOutTradeNo(args[8]);
    Payer payer = new Payer();
    payer.setOpenid(args[10]);
    prepay.setPayer(payer);
    PrepayWithRequestPaymentResponse params = service.prepayWithRequestPayment(prepay);
    JsonObject out = new JsonObject();
    out.addProperty("appId", params.getAppId());
    out.addProperty("timeStamp", params.getTimeStamp());
    out.addProperty("nonceStr", params.getNonceStr());
    out.addProperty("package", params.getPackageVal());
    out.addProperty("signType", params.getSignType());
    out.addProperty("paySign", params.getPaySign());
    System.out.println(GSON.toJson(out));
  }

  private static void listen(String[] args) throws Exception {
    RSAPublicKeyConfig config =
        new RSAPublicKeyConfig.Builder()
            .merchantId("unused")
            .privateKey(PemUtil.loadPrivateKeyFromString(generatedKey()))
            .merchantSerialNumber("unused")
            .publicKeyFromPath(args[2])
            .publicKeyId(args[1])
            .apiV3Key(args[3])
            .build();
    NotificationParser parser = new NotificationParser(config);
    HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    server.createContext(
        "/",
        exchange -> {
          String body;
          try (InputStream in = exchange.getRequestBody()) {
            body = new String(in.readAllBytes(), StandardCharsets.UTF_8);
          }
          var h = exchange.getRequestHeaders();
          RequestParam param =
              new RequestParam.Builder()
                  .serialNumber(h.getFirst("Wechatpay-Serial"))
                  .nonce(h.getFirst("Wechatpay-Nonce"))
                  .signature(h.getFirst("Wechatpay-Signature"))
                  .timestamp(h.getFirst("Wechatpay-Timestamp"))
                  .signType(h.getFirst("Wechatpay-Signature-Type"))
                  .body(body)
                  .build();
          int status;
          try {
            Transaction t = parser.parse(param, Transaction.class);
            System.out.println(
                "{\"parsed\":true,\"out_trade_no\":\"" + t.getOutTradeNo() + "\",\"trade_state\":\""
                    + t.getTradeState() + "\",\"total\":" + t.getAmount().getTotal() + "}");
            status = 204;
          } catch (RuntimeException e) {
            System.out.println("{\"parsed\":false,\"error\":" + GSON.toJson(e.getClass().getSimpleName()) + "}");
            status = 401;
          }
          System.out.flush();
          exchange.sendResponseHeaders(status, -1);
          exchange.close();
        });
    server.start();
    System.out.println("{\"url\":\"http://127.0.0.1:" + server.getAddress().getPort() + "/\"}");
    System.out.flush();
  }

  /** A merchant key the listener never uses (the config requires one). */
  private static String generatedKey() throws Exception {
    var generator = java.security.KeyPairGenerator.getInstance("RSA");
    generator.initialize(2048);
    PrivateKey key = generator.generateKeyPair().getPrivate();
    return "-----BEGIN PRIVATE KEY-----\n"
        + java.util.Base64.getMimeEncoder().encodeToString(key.getEncoded())
        + "\n-----END PRIVATE KEY-----\n";
  }

  private static void signCallback(String[] args) throws Exception {
    String url = args[1];
    String serial = args[2];
    PrivateKey key = PemUtil.loadPrivateKeyFromPath(args[3]);
    AeadAesCipher cipher = new AeadAesCipher(args[4].getBytes(StandardCharsets.UTF_8));
    String nonce = UUID.randomUUID().toString().replace("-", "").substring(0, 12);
    JsonObject transaction = new JsonObject();
    transaction.addProperty("mchid", "1900000001");
    transaction.addProperty("appid", "wxd678efh567hg6787");
    transaction.addProperty("out_trade_no", args[5]);
    transaction.addProperty("transaction_id", "4200000000" + System.nanoTime());
    transaction.addProperty("trade_type", "NATIVE");
    transaction.addProperty("trade_state", "SUCCESS");
    transaction.addProperty("trade_state_desc", "支付成功");
    transaction.addProperty("success_time", "2026-12-04T12:00:00+08:00");
    JsonObject amount = new JsonObject();
    amount.addProperty("total", Long.parseLong(args[6]));
    amount.addProperty("payer_total", Long.parseLong(args[6]));
    amount.addProperty("currency", "CNY");
    transaction.add("amount", amount);
    String ciphertext =
        cipher.encrypt(
            "transaction".getBytes(StandardCharsets.UTF_8),
            nonce.getBytes(StandardCharsets.UTF_8),
            GSON.toJson(transaction).getBytes(StandardCharsets.UTF_8));
    JsonObject resource = new JsonObject();
    resource.addProperty("original_type", "transaction");
    resource.addProperty("algorithm", "AEAD_AES_256_GCM");
    resource.addProperty("ciphertext", ciphertext);
    resource.addProperty("associated_data", "transaction");
    resource.addProperty("nonce", nonce);
    JsonObject notification = new JsonObject();
    notification.addProperty("id", UUID.randomUUID().toString());
    notification.addProperty("create_time", "2026-12-04T12:00:00+08:00");
    notification.addProperty("resource_type", "encrypt-resource");
    notification.addProperty("event_type", "TRANSACTION.SUCCESS");
    notification.addProperty("summary", "支付成功");
    notification.add("resource", resource);
    String body = GSON.toJson(notification);
    String timestamp = Long.toString(Instant.now().getEpochSecond());
    String signatureNonce = UUID.randomUUID().toString().replace("-", "");
    String signature =
        new RSASigner(serial, key)
            .sign(timestamp + "\n" + signatureNonce + "\n" + body + "\n")
            .getSign();
    var answer =
        java.net.http.HttpClient.newHttpClient()
            .send(
                HttpRequest.newBuilder(URI.create(url))
                    .header("content-type", "application/json")
                    .header("Wechatpay-Serial", serial)
                    .header("Wechatpay-Timestamp", timestamp)
                    .header("Wechatpay-Nonce", signatureNonce)
                    .header("Wechatpay-Signature", signature)
                    .header("Wechatpay-Signature-Type", "WECHATPAY2-SHA256-RSA2048")
                    .POST(HttpRequest.BodyPublishers.ofString(body))
                    .build(),
                HttpResponse.BodyHandlers.ofString());
    System.out.println("{\"status\":" + answer.statusCode() + "}");
  }
}
